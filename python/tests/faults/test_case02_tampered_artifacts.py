"""Case 2: every artifact the pipeline downloads, served tampered (its bytes changed, the pin unchanged).

A second server in the sandbox's mirror container serves each stand-in with bytes appended under its real
file name; the stage that needs it runs from site.yml against that source. The host fails in that stage with
a message naming the file and both sums, nothing is installed from it, and no file is left under the
artifact's final name, on the host or in the controller's cache. The fleet's own source (the controller
downloads once, then copies) runs in `make test`; each host downloading from a mirror runs in `make faults`.
(test_artifact_fetch.py, test_cuda_toolkit.py and test_cudnn.py prove the same against a wrong pin.)
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.faults.tools import MirrorServer
from tests.pins import CUDA_HOME

from p40fleet_dev import fixtures
from p40fleet_dev.sandbox import podman

pytestmark = [pytest.mark.sandbox, pytest.mark.fault_case(2)]

HOST = "node7"
TAMPERED_PORT = 8093
SUFFIX = b"\n# p40fleet fault suite: bytes someone appended\n"


@dataclass(frozen=True)
class Artifact:
    name: str  # artifact_fetch_name, the controller cache's sub-directory
    subdir: str  # where the sandbox mirror serves it
    url_var: str
    sha_var: str
    stage: str
    dest: str
    installed: tuple[str, ...]  # what the stage would have installed from it

    @property
    def file(self) -> str:
        return Path(self.dest).name


ARTIFACTS = (
    Artifact(
        "miniconda",
        "miniconda",
        "conda_env_installer_url",
        "conda_env_installer_sha256",
        "conda_env",
        "/var/tmp/p40fleet/Miniconda3-standin-Linux-x86_64.sh",
        ("/opt/miniconda3/bin", "/opt/miniconda3/.p40fleet-installer.sha256", "/opt/miniconda3/envs"),
    ),
    Artifact(
        "cuda_runfile",
        "cuda_runfile",
        "cuda_toolkit_runfile_url",
        "cuda_toolkit_runfile_sha256",
        "cuda_toolkit",
        "/var/tmp/p40fleet/cuda_toolkit.p40fleet/cuda_11.8.0_520.61.05_linux.run",
        (CUDA_HOME, "/var/lib/p40fleet/cuda_toolkit-cuda-11.8.installing", "/usr/local/cuda"),
    ),
    # cuDNN links into the toolkit: the host gets the genuine toolkit first.
    Artifact(
        "cudnn_tarball",
        "cudnn_tarball",
        "cudnn_tarball_url",
        "cudnn_tarball_sha256",
        "cudnn",
        "/var/tmp/p40fleet/cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz",
        (
            "/usr/local/cudnn-8.9.7-cuda11",
            "/usr/local/cudnn-8.9.7-cuda11.p40fleet-staging",
            "/var/lib/p40fleet/cudnn.json",
        ),
    ),
)


@pytest.fixture(scope="module")
def tampered(fleet) -> dict[str, tuple[str, str, str]]:
    """The tampered source: {artifact: (url, pinned sha256, sha256 of what it serves)}."""
    standins = fixtures.build_standins()
    server = MirrorServer(fleet.sandbox, TAMPERED_PORT, "tampered")
    served = {}
    for artifact in ARTIFACTS:
        genuine = (standins.mirror_dir / artifact.subdir / artifact.file).read_bytes()
        pin = standins.group_vars[artifact.sha_var]
        assert hashlib.sha256(genuine).hexdigest() == pin  # the mirror's own copy is the pinned file
        server.exec(f"mkdir -p {server.root}/{artifact.subdir}")
        podman(
            "exec",
            "-i",
            server.container,
            "sh",
            "-c",
            f"cat > {server.root}/{artifact.subdir}/{artifact.file}",
            input_bytes=genuine + SUFFIX,
        )
        served[artifact.name] = (
            f"{server.url}/{artifact.subdir}/{artifact.file}",
            pin,
            hashlib.sha256(genuine + SUFFIX).hexdigest(),
        )
    server.start()
    return served


def installer_runs(fleet) -> str:
    return fleet.sh(HOST, "grep -c 'Arguments:' /var/log/cuda-installer.log 2>/dev/null || true")


def run_tampered(fleet, artifact: Artifact, tampered, extra: dict):
    url, _, _ = tampered[artifact.name]
    runs_before = installer_runs(fleet)
    result = fleet.play(HOST, stages=(artifact.stage,), extra_vars={artifact.url_var: url, **extra})
    assert result.rc != 0
    assert {f.host for f in result.failures} == {HOST}
    # get_url's own failure is rescued into the role's message, the host's last failure event.
    failures = [f for f in result.failures if f.task.startswith("Fail with")]
    assert len(failures) == 1 and result.failures[-1] is failures[0], [f.message for f in result.failures]
    # Nothing installed from it, nothing under its final name on the host.
    for path in artifact.installed:
        assert not fleet.exists(HOST, path), path
    assert not fleet.exists(HOST, artifact.dest)
    assert fleet.sh(HOST, f"ls -A {Path(artifact.dest).parent} 2>/dev/null || true") == ""
    assert installer_runs(fleet) == runs_before
    return failures[0].message


def needs_the_artifact(fleet, artifact: Artifact) -> None:
    """Put the host where the stage must fetch the artifact: nothing of it installed, the stages before it done."""
    if artifact.name == "cudnn_tarball" and not fleet.exists(HOST, f"{CUDA_HOME}/version.json"):
        # The toolkit stage alone (it installs its installer's one package itself): the prerequisites stage's apt
        # transaction is no part of the case.
        toolkit = fleet.play(HOST, stages=("cuda_toolkit",))
        assert toolkit.rc == 0, [f.message for f in toolkit.failures]
    if artifact.name == "cuda_runfile":
        fleet.sh(HOST, f"rm -rf {CUDA_HOME} /usr/local/cuda /var/lib/p40fleet/cuda_toolkit-*.installing")


@pytest.mark.parametrize("artifact", ARTIFACTS, ids=[a.name for a in ARTIFACTS])
def test_controller_source_refuses_the_tampered_file_and_caches_nothing(fleet, tampered, artifact, tmp_path):
    needs_the_artifact(fleet, artifact)
    url, pin, found = tampered[artifact.name]
    cache = tmp_path / "controller-cache"
    message = run_tampered(fleet, artifact, tampered, {"artifact_fetch_controller_cache_dir": str(cache)})
    cached = f"{cache}/{artifact.name}/{artifact.file}"
    expected = (
        f"{HOST}: getting {artifact.name} through the controller cache ({cached}, from {url}) failed: "
        f"{artifact.name}: {url} gave a file with sha256 {found}, but the pin is {pin}. Refused: nothing was kept at"
        f" {cached}. Check that the URL (or mirror) serves the pinned file and that the pin is right. Required: the"
        f" file with sha256 {pin}. Check the controller's network and disk, and that the pin matches."
    )
    assert message == expected
    # The controller keeps nothing either: no file under the final name, no partial download.
    assert sorted(p.name for p in (cache / artifact.name).iterdir()) == []


@pytest.mark.faults_full
@pytest.mark.parametrize("artifact", ARTIFACTS, ids=[a.name for a in ARTIFACTS])
def test_mirror_source_refuses_the_tampered_file_on_each_host(fleet, tampered, artifact):
    needs_the_artifact(fleet, artifact)
    url, pin, found = tampered[artifact.name]
    base = url.rsplit("/", 1)[0] + "/"
    extra = {"artifact_fetch_source": "mirror", "p40fleet_mirror_base_url": base}
    message = run_tampered(fleet, artifact, tampered, extra)
    partial = f"{Path(artifact.dest).parent}/.{artifact.file}.partial/"
    expected = (
        re.escape(f"{HOST}: fetching {artifact.name} from {url} (mirror) failed: The checksum for {partial}")
        + r"[^ /]+"
        + re.escape(
            f" did not match {pin}; it was {found}. Required: the file with sha256 {pin}. Nothing was kept at"
            f" {artifact.dest}. Check the URL or mirror, the network, and that the pin matches the file."
        )
    )
    assert re.fullmatch(expected, message), message
