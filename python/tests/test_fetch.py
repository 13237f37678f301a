"""p40fleet fetch: resumed downloads, refused checksums, valid files kept, against a server on 127.0.0.1.

No network but loopback: the pins of a throwaway inventory point at the local server (group_vars override
the role defaults' URLs and sums), whose log says which requests were made and with which byte range.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest
import yaml

from p40fleet import cli
from p40fleet.fetch import NETWORK_CHUNK, Download, Fetcher, FetchError, controller_cache_downloads, read_pins
from p40fleet_dev.paths import REPO_ROOT
from tests.http_server import FileServer, serve_files

SIZE = 3 * 1024 * 1024 + 123
CUT = 1024 * 1024 + 7


def payload(seed: int, size: int = SIZE) -> bytes:
    return random.Random(seed).randbytes(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def server():
    files = FileServer(files={"/artifact.run": payload(1)})
    running = serve_files(files)
    yield files
    running.stop()


def download(server: FileServer, dest: Path, data: bytes | None = None, path: str = "/artifact.run") -> Download:
    data = server.files[path] if data is None else data
    return Download("test_artifact", server.base_url + path, dest, frozenset({sha256(data)}), len(data))


def fetcher(**kwargs) -> Fetcher:
    return Fetcher(backoff=0.0, **kwargs)


def test_a_connection_cut_mid_file_is_resumed_from_where_it_stopped(server, tmp_path):
    server.cut_after["/artifact.run"] = CUT
    dest = tmp_path / "cache" / "artifact.run"
    outcome = fetcher().fetch(download(server, dest))
    assert dest.read_bytes() == server.files["/artifact.run"]
    assert not dest.with_name("artifact.run.partial").exists()
    first, second = server.log
    assert (first.range, first.status, first.bytes_sent) == (None, 200, CUT)
    # The second request asks for the rest from what the partial file held: at most the block being read when
    # the connection broke is fetched twice.
    kept = int(second.range.removeprefix("bytes=").removesuffix("-"))
    assert CUT - NETWORK_CHUNK < kept <= CUT
    assert (second.status, second.bytes_sent) == (206, SIZE - kept)
    assert outcome.state == "downloaded" and outcome.bytes_transferred == SIZE


def test_an_interrupted_run_leaves_a_partial_file_the_next_run_resumes(server, tmp_path):
    server.cut_after["/artifact.run"] = CUT
    dest = tmp_path / "artifact.run"
    with pytest.raises(FetchError, match=r"failed 1 times .*cut after .* the next run resumes"):
        fetcher(retries=0).fetch(download(server, dest))
    assert not dest.exists()
    kept = dest.with_name("artifact.run.partial").stat().st_size
    assert CUT - NETWORK_CHUNK < kept <= CUT

    outcome = fetcher().fetch(download(server, dest))
    assert outcome.state == "resumed"
    assert dest.read_bytes() == server.files["/artifact.run"]
    assert server.log[-1].range == f"bytes={kept}-" and server.log[-1].bytes_sent == SIZE - kept


def test_a_bad_checksum_is_refused_naming_the_file_and_both_sums(server, tmp_path):
    dest = tmp_path / "artifact.run"
    pinned = sha256(b"the file the pin names")
    bad = Download("cuda_runfile", server.base_url + "/artifact.run", dest, frozenset({pinned}))
    with pytest.raises(FetchError) as error:
        fetcher().fetch(bad)
    message = str(error.value)
    assert "cuda_runfile" in message and "/artifact.run" in message and str(dest) in message
    assert sha256(server.files["/artifact.run"]) in message and pinned in message
    assert not dest.exists()
    assert list(tmp_path.iterdir()) == []  # no partial file either


def test_an_already_valid_file_is_kept_without_any_request(server, tmp_path):
    dest = tmp_path / "artifact.run"
    dest.write_bytes(server.files["/artifact.run"])
    before = dest.stat().st_mtime_ns
    outcome = fetcher().fetch(download(server, dest))
    assert outcome.state == "present"
    assert server.log == []
    assert dest.stat().st_mtime_ns == before


def test_a_wrong_file_under_the_final_name_is_replaced(server, tmp_path):
    dest = tmp_path / "artifact.run"
    dest.write_bytes(b"truncated")
    assert fetcher().fetch(download(server, dest)).state == "downloaded"
    assert dest.read_bytes() == server.files["/artifact.run"]


def test_a_server_ignoring_ranges_sends_the_whole_file_again(server, tmp_path):
    server.ignore_range = True
    dest = tmp_path / "artifact.run"
    dest.with_name("artifact.run.partial").write_bytes(server.files["/artifact.run"][:CUT])
    assert fetcher().fetch(download(server, dest)).state == "resumed"
    assert dest.read_bytes() == server.files["/artifact.run"]
    assert [(s.range, s.status) for s in server.log] == [(f"bytes={CUT}-", 200)]


def test_a_partial_file_of_another_file_is_thrown_away_and_fetched_again(server, tmp_path):
    dest = tmp_path / "artifact.run"
    dest.with_name("artifact.run.partial").write_bytes(payload(2, CUT))  # an older release under this name
    assert fetcher().fetch(download(server, dest)).state == "downloaded"
    assert dest.read_bytes() == server.files["/artifact.run"]
    assert [(s.range, s.status) for s in server.log] == [(f"bytes={CUT}-", 206), (None, 200)]


def test_an_http_error_is_reported_and_leaves_nothing(server, tmp_path):
    dest = tmp_path / "missing.run"
    missing = Download("miniconda", server.base_url + "/missing.run", dest, frozenset({sha256(b"x")}))
    with pytest.raises(FetchError, match=r"miniconda: .*/missing.run answered HTTP 404"):
        fetcher().fetch(missing)
    assert list(tmp_path.iterdir()) == []
    assert not dest.exists()


# -- the pins, and the controller cache artifact_fetch reads --------------------------------------------

ARTIFACTS = {
    # artifact_fetch name: (URL variable, sha256 variable, served file)
    "cuda_runfile": ("cuda_toolkit_runfile_url", "cuda_toolkit_runfile_sha256", "cuda_11.8.0_520.61.05_linux.run"),
    "cudnn_tarball": ("cudnn_tarball_url", "cudnn_tarball_sha256", "cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz"),
    "miniconda": ("conda_env_installer_url", "conda_env_installer_sha256", "Miniconda3-py310_23.3.1-0-Linux-x86_64.sh"),
}


@pytest.fixture
def local_fleet(tmp_path):
    """An inventory whose pins point at a local server; its host is never contacted."""
    files = FileServer()
    group_vars = {"artifact_fetch_controller_cache_dir": str(tmp_path / "controller-cache")}
    for seed, (_, sha_var, name) in enumerate(ARTIFACTS.values(), start=10):
        files.files[f"/pinned/{name}"] = payload(seed, 4096 + seed)
        group_vars[sha_var] = sha256(files.files[f"/pinned/{name}"])
    running = serve_files(files)
    for url_var, _, name in ARTIFACTS.values():
        group_vars[url_var] = f"{running.base_url}/pinned/{name}"
    group_vars["cuda_toolkit_runfile_size_bytes"] = len(files.files["/pinned/cuda_11.8.0_520.61.05_linux.run"])
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    hosts = {"all": {"children": {"p40-hosts": {"hosts": {"gpu-01": {"ansible_host": "192.0.2.1"}}}}}}
    (inventory / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (inventory / "group_vars" / "p40-hosts.yml").write_text(yaml.safe_dump(group_vars))
    yield inventory, files, tmp_path / "controller-cache"
    running.stop()


def test_the_pins_are_read_from_the_inventory_over_the_role_defaults(local_fleet):
    inventory, files, cache = local_fleet
    (pins,) = read_pins(inventory / "hosts.yml")
    assert pins.host == "gpu-01"
    assert {a.name: a.url for a in pins.artifacts} == {
        name: f"{files.base_url}/pinned/{served}" for name, (_, _, served) in ARTIFACTS.items()
    }
    assert pins.controller_cache_dir == cache
    # What the inventory does not set is the role default.
    assert pins.torch_requirements == ["torch==2.6.0+cu118"]
    assert pins.verl_lock == REPO_ROOT / "roles" / "verl" / "files" / "verl-0.4.1-py310.lock.txt"


def test_fetch_fills_the_controller_cache_as_artifact_fetch_reads_it_then_requests_nothing(local_fleet):
    inventory, files, cache = local_fleet
    assert cli.main(["fetch", "-i", str(inventory / "hosts.yml")]) == 0
    for name, (_, _, served) in ARTIFACTS.items():
        # roles/artifact_fetch/tasks/fetch_controller.yml: <cache dir>/<artifact_fetch_name>/<URL's file name>
        assert (cache / name / served).read_bytes() == files.files[f"/pinned/{served}"]
    assert len(files.log) == len(ARTIFACTS)
    assert cli.main(["fetch", "-i", str(inventory / "hosts.yml")]) == 0
    assert len(files.log) == len(ARTIFACTS)


def test_fetch_with_a_bad_pin_exits_1_and_keeps_nothing(local_fleet, capsys):
    inventory, _, cache = local_fleet
    group_vars = inventory / "group_vars" / "p40-hosts.yml"
    values = yaml.safe_load(group_vars.read_text())
    values["cudnn_tarball_sha256"] = sha256(b"another archive")
    group_vars.write_text(yaml.safe_dump(values))
    assert cli.main(["fetch", "-i", str(inventory / "hosts.yml")]) == 1
    assert "cudnn_tarball" in capsys.readouterr().err
    assert not (cache / "cudnn_tarball" / ARTIFACTS["cudnn_tarball"][2]).exists()


def test_every_artifact_the_roles_fetch_is_in_the_pins_playbook():
    """playbooks/pins.yml lists each artifact_fetch call of the roles, with the same name and pin variables."""
    calls = set()

    def walk(tasks):
        for task in tasks or []:
            for key in ("block", "rescue", "always"):
                walk(task.get(key))
            include = task.get("ansible.builtin.include_role") or task.get("ansible.builtin.import_role") or {}
            if include.get("name") == "artifact_fetch":
                v = task["vars"]
                calls.add((v["artifact_fetch_name"], v["artifact_fetch_url"], v["artifact_fetch_sha256"]))

    for path in sorted((REPO_ROOT / "roles").glob("*/tasks/*.yml")):
        walk(yaml.safe_load(path.read_text()))
    (play,) = yaml.safe_load((REPO_ROOT / "playbooks" / "pins.yml").read_text())
    listed = {(a["name"], a["url"], a["sha256"]) for a in play["tasks"][0]["ansible.builtin.debug"]["msg"]["artifacts"]}
    assert calls, "no role calls artifact_fetch"
    assert calls == listed


def test_two_pins_for_one_cache_file_are_refused(tmp_path):
    from p40fleet.fetch import Artifact, HostPins

    def host(name: str, sha: str) -> HostPins:
        artifact = Artifact("cudnn_tarball", "https://example.invalid/cudnn.tar.xz", sha)
        return HostPins(name, [artifact], tmp_path, "3.10", {}, [], {})

    with pytest.raises(FetchError, match="two different pins want this file name"):
        controller_cache_downloads([host("a", "a" * 64), host("b", "b" * 64)])
    assert len(controller_cache_downloads([host("a", "a" * 64), host("b", "a" * 64)])) == 1


# -- the role's controller download: the same downloader, through Ansible ------------------------------

CACHE_PLAYBOOK = """\
- hosts: local
  gather_facts: false
  tasks:
    - name: Fill the controller cache
      p40fleet.fleet.artifact_fetch_cache:
        artifacts: "{{ wanted }}"
        attempts: "{{ attempts }}"
      register: filled
      ignore_errors: true
    - name: Show it
      ansible.builtin.debug:
        var: filled
"""


@pytest.fixture
def cache_play(tmp_path, run_playbook):
    """Run roles/artifact_fetch's action plugin (what fetch_controller.yml runs) on the controller, by its full
    name; -> the registered result."""
    playbook = tmp_path / "cache.yml"
    playbook.write_text(CACHE_PLAYBOOK)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"local": {"ansible_connection": "local"}}}}))

    def play(wanted, attempts=3, check=False):
        result = run_playbook(
            playbook,
            inventory,
            check=check,
            extra_vars={"wanted": wanted, "attempts": attempts},
        )
        (shown,) = [
            e["event_data"]["res"]["filled"]
            for e in result.events
            if e.get("event") == "runner_on_ok" and e["event_data"].get("task") == "Show it"
        ]
        return shown

    return play


def test_the_roles_controller_download_resumes_and_refuses_as_p40fleet_fetch_does(server, tmp_path, cache_play):
    server.files["/other.run"] = payload(2, 4096)
    cache = tmp_path / "controller-cache"
    artifact = {
        "name": "cuda_runfile",
        "url": server.base_url + "/artifact.run",
        "sha256": sha256(server.files["/artifact.run"]),
        "path": str(cache / "cuda_runfile" / "artifact.run"),
    }
    tampered = {
        "name": "cudnn_tarball",
        "url": server.base_url + "/other.run",
        "sha256": sha256(b"the pinned archive"),
        "path": str(cache / "cudnn_tarball" / "other.run"),
    }
    # Check mode: what a run would fetch, and no request.
    shown = cache_play([artifact], check=True)
    assert [(r["state"], r["changed"]) for r in shown["results"]] == [("absent", True)]
    assert server.log == []
    # One attempt, cut mid-file: that artifact fails alone, its bytes kept for the next run; the tampered one is
    # refused with both sums and nothing kept.
    server.cut_after["/artifact.run"] = CUT
    shown = cache_play([artifact, tampered], attempts=1)
    cut, refused = shown["results"]
    assert cut["failed"] and "the next run resumes from there" in cut["msg"], cut
    kept = Path(artifact["path"] + ".partial").stat().st_size
    assert CUT - NETWORK_CHUNK < kept <= CUT
    assert refused["failed"] and refused["msg"] == (
        f"cudnn_tarball: {tampered['url']} gave a file with sha256 {sha256(server.files['/other.run'])}, but the pin"
        f" is {tampered['sha256']}. Refused: nothing was kept at {tampered['path']}. Check that the URL (or mirror)"
        " serves the pinned file and that the pin is right."
    )
    assert sorted(p.name for p in (cache / "cudnn_tarball").iterdir()) == []
    # The next run resumes from the kept bytes; the one after finds the file and requests nothing.
    shown = cache_play([artifact])
    assert [(r["state"], r["changed"]) for r in shown["results"]] == [("resumed", True)]
    assert server.log[-1].range == f"bytes={kept}-"
    assert Path(artifact["path"]).read_bytes() == server.files["/artifact.run"]
    requests = len(server.log)
    shown = cache_play([artifact])
    assert [(r["state"], r["changed"]) for r in shown["results"]] == [("present", False)]
    assert len(server.log) == requests
