"""cudnn on sandbox hosts with the stand-in archive: unpack with symlinks, link into CUDA, replace cleanly.

Runs the CUDA play first (cudnn links into the toolkit tree), then the cudnn play, as site.yml does: the check
mode, the fresh install and the reruns. The cases that change only cuDNN's files afterwards (another version, a
tampered archive) run the cudnn play alone (CUDNN_ONLY): the stages before it are converged and proven idempotent
by then, and running them again cost each case two hosts' passes through host_prereqs and cuda_toolkit.
Tests run in order on one fleet; each asserts the hosts' real files and links.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from p40fleet_dev.sandbox import Sandbox
from tests.host_state import exists, sh
from tests.pins import CUDA_HOME

# The modules of this group share the sandbox "cuda": one pytest-xdist worker runs them, in order.
pytestmark = [pytest.mark.sandbox, pytest.mark.xdist_group("cuda-sandbox")]

PLAYBOOK = "python/tests/playbooks/cuda_cudnn.yml"
HOSTS = ("node1", "node2")
# The cudnn play alone, on hosts the whole playbook converged (test_fresh_install_..., test_rerun_...).
CUDNN_ONLY = {"tags": "cudnn"}
CUDA = CUDA_HOME
PREFIX = "/usr/local/cudnn-8.9.7-cuda11"
OLD_PREFIX = "/usr/local/cudnn-8.9.6-cuda11"
STATE = "/var/lib/p40fleet/cudnn.json"
TARBALL = "/var/tmp/p40fleet/cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz"
LD_CONF = "/etc/ld.so.conf.d/p40fleet-cudnn.conf"
# What the stand-in archive holds (python/tests/fixtures/standins/artifacts/cudnn_tarball.py).
LIBS = [f"{lib}{suffix}" for lib in ("libcudnn", "libcudnn_ops_infer") for suffix in (".so", ".so.8", ".so.8.9.7")]
HEADERS = ["cudnn.h", "cudnn_version.h"]


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    sandbox = make_sandbox("cuda", ["p40", "p40"], login="sudo")
    # The fleet is shared with other modules: start from hosts without any cuDNN state.
    for host in HOSTS:
        reset = sandbox.exec(
            host, f"rm -rf /usr/local/cudnn-* {STATE} {LD_CONF} {CUDA}/lib64/*cudnn* {CUDA}/include/cudnn*"
        )
        assert reset.returncode == 0, reset.stderr
    return sandbox


@pytest.fixture(scope="module")
def converge(fleet, run_playbook, tmp_path_factory):
    cache = tmp_path_factory.mktemp("controller-cache")

    def run(extra_vars: dict | None = None, **kwargs):
        # A private controller cache: the stand-ins carry the real file names.
        variables = {"artifact_fetch_controller_cache_dir": str(cache), **(extra_vars or {})}
        return run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=variables, **kwargs)

    return run


def cudnn_links(fleet: Sandbox, host: str) -> dict[str, str]:
    """Every cuDNN symlink in the CUDA tree and its target."""
    out = sh(fleet, host, f"find {CUDA}/lib64 {CUDA}/include -name '*cudnn*' -type l -printf '%p %l\\n'")
    return dict(line.split(" ", 1) for line in out.splitlines())


def assert_installed(fleet: Sandbox, host: str) -> None:
    header = sh(fleet, host, f"cat {PREFIX}/include/cudnn_version.h")
    assert "#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n#define CUDNN_PATCHLEVEL 7" in header
    # The archive's symlinks stayed symlinks (a copy without -P makes ldconfig complain).
    assert sh(fleet, host, f"readlink {PREFIX}/lib/libcudnn.so {PREFIX}/lib/libcudnn.so.8").split() == [
        "libcudnn.so.8",
        "libcudnn.so.8.9.7",
    ]
    assert sh(fleet, host, f"find {PREFIX}/lib -type f -printf '%f\\n' | sort").split() == [
        "libcudnn.so.8.9.7",
        "libcudnn_ops_infer.so.8.9.7",
    ]
    assert exists(fleet, host, f"{PREFIX}/LICENSE")
    expected = {f"{CUDA}/lib64/{name}": f"{PREFIX}/lib/{name}" for name in LIBS}
    expected.update({f"{CUDA}/include/{name}": f"{PREFIX}/include/{name}" for name in HEADERS})
    assert cudnn_links(fleet, host) == expected
    assert sh(fleet, host, f"readlink -f {CUDA}/lib64/libcudnn.so") == f"{PREFIX}/lib/libcudnn.so.8.9.7"
    assert json.loads(sh(fleet, host, f"cat {STATE}")) == {"prefix": PREFIX, "version": "8.9.7"}
    assert not exists(fleet, host, TARBALL)
    assert not exists(fleet, host, f"{PREFIX}.p40fleet-staging")


def task_hosts(result, task: str) -> set[str]:
    return {
        e["event_data"]["host"]
        for e in result.events
        if e.get("event") == "runner_on_ok" and e["event_data"].get("task") == task
    }


def test_check_mode_reports_the_unpack_and_changes_nothing(fleet, converge):
    result = converge(check=True, diff=True)
    assert result.rc == 0, result.stdout
    assert task_hosts(result, "Report the unpack that check mode cannot do without the archive") == set(HOSTS)
    for host in HOSTS:
        assert result.stats[host]["changed"] > 0
        for path in (PREFIX, f"{PREFIX}.p40fleet-staging", STATE, TARBALL):
            assert not exists(fleet, host, path), f"{host}: check mode created {path}"
        if exists(fleet, host, CUDA):
            assert cudnn_links(fleet, host) == {}


def test_fresh_install_unpacks_with_symlinks_and_links_into_cuda(fleet, converge):
    result = converge()
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert_installed(fleet, host)
        assert not exists(fleet, host, LD_CONF)


def test_rerun_changes_nothing_also_in_check_mode(converge):
    for kwargs in ({}, {"check": True, "diff": True}):
        result = converge(**kwargs)
        assert result.rc == 0, result.stdout
        assert {h: result.stats[h]["changed"] for h in HOSTS} == {"node1": 0, "node2": 0}, kwargs


def test_other_versions_are_replaced_cleanly(fleet, converge):
    # node2: an 8.9.6 that this role installed earlier, in its own prefix, linked into CUDA.
    sh(fleet, "node2", f"rm -rf {PREFIX} && rm -f {CUDA}/lib64/*cudnn* {CUDA}/include/cudnn*")
    sh(
        fleet,
        "node2",
        f"mkdir -p {OLD_PREFIX}/lib {OLD_PREFIX}/include && cd {OLD_PREFIX}"
        " && printf '#define CUDNN_MAJOR 8\\n#define CUDNN_MINOR 9\\n#define CUDNN_PATCHLEVEL 6\\n'"
        " > include/cudnn_version.h && echo old > lib/libcudnn.so.8.9.6"
        " && ln -s libcudnn.so.8.9.6 lib/libcudnn.so.8 && ln -s libcudnn.so.8 lib/libcudnn.so"
        f" && for f in lib/*; do ln -s {OLD_PREFIX}/$f {CUDA}/lib64/; done"
        f" && ln -s {OLD_PREFIX}/include/cudnn_version.h {CUDA}/include/"
        f' && echo \'{{"prefix": "{OLD_PREFIX}", "version": "8.9.6"}}\' > {STATE}',
    )
    # node1: another version at the same prefix, copied without -P (symlinks became files).
    sh(
        fleet,
        "node1",
        f"sed -i 's/CUDNN_PATCHLEVEL 7/CUDNN_PATCHLEVEL 5/' {PREFIX}/include/cudnn_version.h"
        f" && cp --remove-destination -L {PREFIX}/lib/libcudnn.so.8 {PREFIX}/lib/libcudnn.so.8.tmp"
        f" && mv {PREFIX}/lib/libcudnn.so.8.tmp {PREFIX}/lib/libcudnn.so.8",
    )
    assert sh(fleet, "node1", f"test -L {PREFIX}/lib/libcudnn.so.8 || echo file") == "file"

    result = converge(extra_vars={"cudnn_ldconfig": True}, **CUDNN_ONLY)
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert result.stats[host]["changed"] > 0
        assert_installed(fleet, host)
        assert sh(fleet, host, f"grep -v '^#' {LD_CONF}") == f"{PREFIX}/lib"
    assert task_hosts(result, "Refresh the dynamic linker cache for cuDNN") == set(HOSTS)
    assert not exists(fleet, "node2", OLD_PREFIX)


def test_tampered_tarball_fails_the_checksum_and_installs_nothing(fleet, converge):
    sh(fleet, "node1", f"rm -rf {PREFIX}")
    wrong = hashlib.sha256(b"an archive someone tampered with").hexdigest()
    result = converge(extra_vars={"cudnn_ldconfig": True, "cudnn_tarball_sha256": wrong}, **CUDNN_ONLY)
    assert result.rc != 0
    # The failed download is rescued into one message naming the host: the last failure event.
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1"}
    message = messages["node1"]
    assert message.startswith("node1: getting cudnn_tarball through the controller cache"), message
    assert f"but the pin is {wrong}. Refused: nothing was kept at" in message, message
    assert result.stats["node2"]["changed"] == 0
    assert sh(fleet, "node1", "ls -d /usr/local/cudnn* 2>/dev/null || true") == ""
    assert sh(fleet, "node1", "ls -A /var/tmp/p40fleet") == ""
    assert json.loads(sh(fleet, "node1", f"cat {STATE}")) == {"prefix": PREFIX, "version": "8.9.7"}
