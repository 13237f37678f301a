"""`p40fleet bundle`: how its parts choose files and make repositories (no containers), then the expensive test
of this suite: a bundle directory is all a fresh sandbox host needs.

The bundle is made from the sandbox inventory's pins, which point at the sandbox's stand-ins (the CUDA runfile,
cuDNN and Miniconda stand-ins, the stand-in torch builds, the real locked wheels, the Apex and verl repositories).
Then the sandbox's own mirror is stopped and a container of the sandbox network serving the bundle directory
with a plain static server is the hosts' only source, and site.yml provisions a fresh host from it.

What this does not cover, honestly: the stages the bundle does not feed are kept out of the bundle-fed run.
host_prereqs runs first, while the sandbox's apt mirror is up (system packages come from the fleet's OS mirror,
not from a bundle); the bundle-fed run is site.yml with the tags of the stages up to verl_patches, so
training_data and launch_script do not run (the Hub's dataset and model are not in a bundle). conda_env's
stand-in makes venvs and needs no conda channel; a real Miniconda needs one (see p40fleet.bundle). One host,
to keep CI time down.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import requests
import yaml

from p40fleet import cli
from p40fleet.bundle import (
    PINNED_BRANCH,
    Link,
    LinkFinder,
    Pinned,
    RepoPin,
    bundle_repository,
    choose_files,
    hashed_downloads,
    parse_hashed_requirements,
    supported_tags,
)
from p40fleet.fetch import FetchError
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import PODMAN_PREFIX, Sandbox, _wait_for_port, ensure_image, podman
from tests.host_state import sh
from tests.http_server import FileServer, serve_directory, serve_files

ENV_PYTHON = "/opt/miniconda3/envs/verl-env/bin/python"
PORT = 8080
# site.yml's tags for the stages the bundle feeds, after preflight and those they build on.
BUNDLE_STAGES = "gpu_preflight,host_prereqs,cuda_toolkit,cudnn,conda_env,pytorch,apex,verl,verl_patches"


# -- the parts, without containers ----------------------------------------------------------------------


def test_every_lock_of_the_verl_role_parses_pin_by_pin():
    for lock in sorted((REPO_ROOT / "roles" / "verl" / "files").glob("*.lock.txt")):
        text = lock.read_text()
        pins = parse_hashed_requirements(text, lock.name)
        assert len(pins) == len(re.findall(r"^[A-Za-z0-9][^ ]*==", text, flags=re.M)) > 50
        assert all(pin.sha256s for pin in pins)
    with pytest.raises(FetchError, match="line 1 is not 'NAME==VERSION"):
        parse_hashed_requirements("requests>=2 --hash=sha256:" + "0" * 64, "x.txt")


def _link(filename: str, sha: str | None = None) -> Link:
    return Link(f"https://files.example.invalid/{filename}", filename, sha)


CHOICES = [
    # (files offered, files chosen for CPython 3.10 on x86_64 Linux)
    (
        [
            "demo-1.0-cp310-cp310-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
            "demo-1.0-cp310-cp310-manylinux_2_28_x86_64.whl",
            "demo-1.0-cp310-cp310-musllinux_1_1_x86_64.whl",
            "demo-1.0-cp310-cp310-macosx_11_0_arm64.whl",
            "demo-1.0-cp311-cp311-manylinux_2_17_x86_64.whl",
            "demo-1.0-cp310-cp310-manylinux_2_34_x86_64.whl",
            "demo-1.0.tar.gz",
        ],
        [
            "demo-1.0-cp310-cp310-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
            "demo-1.0-cp310-cp310-manylinux_2_28_x86_64.whl",
        ],
    ),
    (["demo-1.0-py3-none-any.whl", "demo-1.0.tar.gz", "demo-1.1-py3-none-any.whl"], ["demo-1.0-py3-none-any.whl"]),
    (["demo-1.0.tar.gz", "demo-1.0-cp312-cp312-manylinux_2_17_x86_64.whl"], ["demo-1.0.tar.gz"]),
    (["demo-1.0-cp38-abi3-manylinux_2_17_x86_64.whl"], ["demo-1.0-cp38-abi3-manylinux_2_17_x86_64.whl"]),
    (["demo-1.0-cp310-cp310-win_amd64.whl"], []),
]


@pytest.mark.parametrize(("offered", "chosen"), CHOICES)
def test_the_files_of_a_pin_that_a_fleet_host_can_install_are_chosen(offered, chosen):
    pin = Pinned("demo", "1.0", frozenset({"a" * 64}))
    found = choose_files(pin, [_link(name) for name in offered], supported_tags("3.10"))
    assert [link.filename for link in found] == chosen


def test_a_file_whose_listed_sha256_is_not_pinned_is_never_chosen():
    pin = Pinned("demo", "1.0", frozenset({"a" * 64}))
    offered = [_link("demo-1.0-py3-none-any.whl", "b" * 64), _link("demo-1.0.tar.gz", "a" * 64)]
    assert [link.filename for link in choose_files(pin, offered, supported_tags("3.10"))] == ["demo-1.0.tar.gz"]


def test_indexes_and_find_links_pages_are_read_as_pip_reads_them():
    wheel, sdist = b"a wheel", b"an sdist"
    server = FileServer()
    running = serve_files(server)
    try:
        base = running.base_url
        server.files["/simple/demo-pkg/"] = json.dumps(
            {"files": [{"filename": "demo_pkg-1.0-py3-none-any.whl", "url": "../../files/demo_pkg-1.0-py3-none-any.whl",
                        "hashes": {"sha256": pin_sha(wheel)}}]}
        ).encode()  # fmt: skip
        server.content_types["/simple/demo-pkg/"] = "application/vnd.pypi.simple.v1+json"
        server.files["/links/"] = b'<html><a href="demo_pkg-1.0.tar.gz">demo_pkg-1.0.tar.gz</a></html>'
        server.content_types["/links/"] = "text/html"
        pin = Pinned("demo-pkg", "1.0", frozenset({pin_sha(wheel), pin_sha(sdist)}))
        finder = LinkFinder(requests.Session())
        found = finder.files("Demo_Pkg", [f"{base}/simple"], [f"{base}/links/"])
        assert found == [
            Link(f"{base}/files/demo_pkg-1.0-py3-none-any.whl", "demo_pkg-1.0-py3-none-any.whl", pin_sha(wheel)),
            Link(f"{base}/links/demo_pkg-1.0.tar.gz", "demo_pkg-1.0.tar.gz", None),
        ]
        sources = [f"{base}/simple"], [f"{base}/links/"]
        (download,) = hashed_downloads([pin], "test", "3.11", *sources, Path("/w"), finder)
        assert download.url == f"{base}/files/demo_pkg-1.0-py3-none-any.whl" and download.sha256s == pin.sha256s
        missing = Pinned("absent", "2.0", frozenset({"c" * 64}))
        with pytest.raises(FetchError, match=r"no file of absent==2.0 .* Python 3.11"):
            hashed_downloads([missing], "test", "3.11", [f"{base}/simple"], [], Path("/w"), finder)
    finally:
        running.stop()


def pin_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git(*args, cwd=None) -> str:
    return subprocess.run(["git", *map(str, args)], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def upstream_repo(tmp_path) -> tuple[Path, str, str]:
    """A repository with a tagged release and a later commit: (path, the tag's commit, the later commit)."""
    repo = tmp_path / "upstream"
    repo.mkdir()
    env = ["-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    git("init", "-q", "-b", "main", cwd=repo)
    (repo / "version").write_text("1.0\n")
    git("add", "version", cwd=repo)
    git(*env, "commit", "-q", "-m", "1.0", cwd=repo)
    git("tag", "v1.0", cwd=repo)
    released = git("rev-parse", "HEAD", cwd=repo)
    (repo / "version").write_text("1.1.dev\n")
    git(*env, "commit", "-q", "-am", "next", cwd=repo)
    return repo, released, git("rev-parse", "HEAD", cwd=repo)


def test_a_pinned_commit_becomes_a_repository_served_over_plain_http_and_a_bundle(upstream_repo, tmp_path):
    repo, released, _ = upstream_repo
    out = tmp_path / "bundle"
    console = cli.console
    pin = RepoPin("verl", str(repo), "v1.0", released)
    assert bundle_repository(pin, out, console) == "cloned"
    served = out / "git" / "verl.git"
    assert git("rev-parse", PINNED_BRANCH, cwd=served) == released
    assert git("rev-parse", "v1.0^{commit}", cwd=served) == released
    assert git("bundle", "list-heads", out / "git" / "verl.bundle", cwd=served).count(released) == 2
    # The later commit is no part of the pin.
    assert subprocess.run(["git", "-C", served, "cat-file", "-e", git("rev-parse", "main", cwd=repo)],
                          capture_output=True, check=False).returncode != 0  # fmt: skip

    running = serve_directory(out)
    try:
        clone = tmp_path / "clone"
        git("clone", "-q", f"{running.base_url}/git/verl.git", clone)
        git("checkout", "-q", "v1.0", cwd=clone)
        assert (clone / "version").read_text() == "1.0\n"
    finally:
        running.stop()

    repo.rename(tmp_path / "gone")  # a valid repository is kept without reaching its source
    assert bundle_repository(pin, out, console) == "present"


def test_a_ref_that_is_not_the_pinned_commit_is_refused(upstream_repo, tmp_path):
    repo, _, later = upstream_repo
    with pytest.raises(FetchError, match=rf"resolves v1.0 to commit .*, not the pinned {later}"):
        bundle_repository(RepoPin("verl", str(repo), "v1.0", later), tmp_path / "bundle", cli.console)
    assert not (tmp_path / "bundle" / "git" / "verl.git").exists()
    assert [p.name for p in (tmp_path / "bundle" / "git").iterdir()] == []


def test_a_commit_pin_is_kept_on_a_branch_of_the_served_repository(upstream_repo, tmp_path):
    repo, released, _ = upstream_repo
    assert bundle_repository(RepoPin("apex", str(repo), released, released), tmp_path, cli.console) == "cloned"
    assert git("symbolic-ref", "HEAD", cwd=tmp_path / "git" / "apex.git") == PINNED_BRANCH
    assert git("rev-parse", "HEAD", cwd=tmp_path / "git" / "apex.git") == released


MIRROR_SOURCES = {
    # host: (its variables, lines its env's pip.conf must hold, lines it must not, apex repository, verl repository)
    "upstream": (
        {},
        ["index-url = https://download.pytorch.org/whl/cu118", "extra-index-url = https://pypi.org/simple"],
        ["no-index = true", "find-links", "trusted-host"],
        "https://github.com/NVIDIA/apex.git",
        "https://github.com/volcengine/verl.git",
    ),
    "plain-http-mirror": (
        {"p40fleet_mirror_base_url": "http://mirror.example.internal:8080/bundle/",
         "pytorch_source": "mirror", "apex_git_source": "mirror", "verl_git_source": "mirror"},
        ["no-index = true", "find-links = http://mirror.example.internal:8080/bundle/wheels/",
         "trusted-host = mirror.example.internal"],
        ["index-url"],
        "http://mirror.example.internal:8080/bundle/git/apex.git",
        "http://mirror.example.internal:8080/bundle/git/verl.git",
    ),
    "https-mirror-of-its-own": (
        {"p40fleet_mirror_base_url": "http://unused.example.internal", "pytorch_source": "mirror",
         "pytorch_mirror_url": "https://wheels.example.internal/b", "pytorch_find_links": ["https://x.invalid/"],
         "pytorch_trusted_hosts": ["x.invalid"]},
        ["no-index = true", "find-links = https://wheels.example.internal/b/wheels/"],
        ["trusted-host", "x.invalid", "index-url"],
        "https://github.com/NVIDIA/apex.git",
        "https://github.com/volcengine/verl.git",
    ),
}  # fmt: skip


def test_each_role_reads_the_bundle_on_the_mirror_in_its_mirror_source(tmp_path):
    from p40fleet.run import run_playbook

    inventory = tmp_path / "inventory"
    (inventory / "host_vars").mkdir(parents=True)
    hosts = {name: {"ansible_host": "192.0.2.1"} for name in MIRROR_SOURCES}
    (inventory / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    for name, (variables, *_) in MIRROR_SOURCES.items():
        (inventory / "host_vars" / f"{name}.yml").write_text(yaml.safe_dump(variables))
    result = run_playbook(REPO_ROOT / "python" / "tests" / "playbooks" / "mirror_sources.yml", inventory / "hosts.yml")
    assert result.rc == 0, result.stdout
    reported = {
        e["event_data"]["host"]: e["event_data"]["res"]["msg"] for e in result.events if e["event"] == "runner_on_ok"
    }
    for name, (_, present, absent, apex, verl) in MIRROR_SOURCES.items():
        lines = reported[name]["pip_conf"].splitlines()
        for line in present:
            assert line in lines, (name, line, lines)
        for fragment in absent:
            assert not any(fragment in line for line in lines if not line.startswith("#")), (name, fragment)
        assert (reported[name]["apex"], reported[name]["verl"]) == (apex, verl), name


# -- the expensive one: a fresh sandbox host provisions from a bundle alone ----------------------------


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    return make_sandbox("bundle", ["p40"])


@pytest.fixture(scope="module")
def bundle_dir(fleet, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    assert cli.main(["bundle", str(out), "-i", str(fleet.inventory_dir / "hosts.yml")]) == 0
    return out


@pytest.fixture(scope="module")
def bundle_server(fleet, bundle_dir):
    """A static HTTP server of the bundle directory on the sandbox network: (its base URL, its container)."""
    container = f"{PODMAN_PREFIX}-{fleet.name}-bundle"
    podman("rm", "-f", container, check=False)
    podman(
        "run", "-d", "--init", "--name", container, "--network", fleet.network,
        "-v", f"{bundle_dir}:/srv/bundle:ro",
        ensure_image(), "python3", "-m", "http.server", str(PORT), "--directory", "/srv/bundle",
    )  # fmt: skip
    address = fleet._address(container)
    _wait_for_port(address, PORT)
    yield f"http://{address}:{PORT}", container
    podman("rm", "-f", "-t", "0", container, check=False)


def served_paths(container: str) -> list[str]:
    logs = podman("logs", container, check=False)
    text = (logs.stdout + logs.stderr).decode(errors="replace")
    return re.findall(r'"GET (\S+) HTTP', text)


@pytest.mark.sandbox
def test_the_bundle_holds_every_pinned_file_verified(bundle_dir, fleet):
    sandbox_vars = yaml.safe_load((fleet.inventory_dir / "group_vars" / "p40_sandbox.yml").read_text())
    for url_var in ("cuda_toolkit_runfile_url", "cudnn_tarball_url", "conda_env_installer_url"):
        assert (bundle_dir / sandbox_vars[url_var].rsplit("/", 1)[-1]).is_file(), url_var
    wheels = {p.name for p in (bundle_dir / "wheels").iterdir()}
    assert {"torch-2.6.0+cu118-py3-none-any.whl", "triton-3.2.0-py3-none-any.whl"} <= wheels
    assert not any(name.startswith("torch-2.7.0") for name in wheels)  # the stand-in index's decoy
    assert sum(name.startswith("ninja-") for name in wheels) == 1
    checked = subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=bundle_dir, check=False)
    assert checked.returncode == 0
    for name, commit_var in (("apex", "apex_git_commit"), ("verl", "verl_expected_commit")):
        head = subprocess.run(
            ["git", "-C", str(bundle_dir / "git" / f"{name}.git"), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert head == sandbox_vars[commit_var]


@pytest.mark.sandbox
def test_a_fresh_host_provisions_from_the_bundle_alone(fleet, run_playbook, bundle_server):
    base_url, container = bundle_server
    # Not site.yml --tags host_prereqs: on a fresh host its verify-only check runs too (tags [verify, never]
    # inherit host_prereqs) and reads the probe from before the install.
    prereqs = run_playbook("python/tests/playbooks/host_prereqs.yml", fleet.inventory_dir)
    assert prereqs.rc == 0, prereqs.stdout
    podman("stop", "-t", "0", fleet.mirror_container)
    running = podman("inspect", "-f", "{{.State.Running}}", fleet.mirror_container).stdout.decode().strip()
    assert running == "false"
    # What a bundle-fed fleet sets (docs/air-gapped.md), and nothing of the sandbox's own sources.
    bundle_vars = {
        "artifact_fetch_source": "mirror",
        "p40fleet_mirror_base_url": base_url,
        "pytorch_source": "mirror",
        "apex_git_source": "mirror",
        "verl_git_source": "mirror",
        "apex_find_links": [],
        "verl_find_links": [],
    }
    host_vars = fleet.inventory_dir / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / "node1.yml").write_text("---\n" + yaml.safe_dump(bundle_vars))

    result = run_playbook("site.yml", fleet.inventory_dir, tags=BUNDLE_STAGES)
    assert result.rc == 0, result.stdout
    assert result.failures == []
    assert result.stats["node1"]["changed"] > 0

    served = served_paths(container)
    for name in ("cuda_11.8.0_520.61.05_linux.run", "cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz"):
        assert f"/{name}" in served
    assert "/wheels/" in served
    assert any(path.startswith("/wheels/torch-2.6.0") for path in served)
    assert any(path.startswith("/git/apex.git/") for path in served)
    assert any(path.startswith("/git/verl.git/") for path in served)
    assert sh(fleet, "node1", f"{ENV_PYTHON} -c 'import torch; print(torch.__version__)'") == "2.6.0+cu118"
    # verl's checkout stays; Apex's was the throwaway build account's and went with it (its clone from the bundle is
    # the served /git/apex.git/ above).
    origin = sh(fleet, "node1", "git config --file /opt/p40fleet/verl/.git/config remote.origin.url")
    assert origin == f"{base_url}/git/verl.git"
    assert fleet.exec("node1", "test -e /opt/p40fleet/apex").returncode != 0
    assert f"find-links = {base_url}/wheels/" in sh(fleet, "node1", "cat /opt/miniconda3/envs/verl-env/pip.conf")

    again = run_playbook("site.yml", fleet.inventory_dir, tags=BUNDLE_STAGES)
    assert again.rc == 0, again.stdout
    assert again.stats["node1"]["changed"] == 0
