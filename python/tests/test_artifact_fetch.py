"""artifact_fetch on sandbox hosts: the three sources, checksum enforcement, no partial files, check mode.

The artifact is the cuDNN stand-in archive served by the sandbox mirror; which requests reached the
mirror is read from its access log, so "downloaded once for the fleet" is measured, not assumed.
"""

from __future__ import annotations

import hashlib

import pytest

from p40fleet_dev.sandbox import Sandbox, podman

# The modules of this group share the sandbox "cuda": one pytest-xdist worker runs them, in order.
pytestmark = [pytest.mark.sandbox, pytest.mark.xdist_group("cuda-sandbox")]

PLAYBOOK = "python/tests/playbooks/artifact_fetch.yml"
FILE_NAME = "cudnn-linux-x86_64-8.9.7.29_cuda11-archive.tar.xz"
REAL_UPSTREAM_URL = "https://developer.download.nvidia.com/compute/cudnn/redist/cudnn/linux-x86_64/" + FILE_NAME
HOSTS = ("node1", "node2")
CONTROLLER_FETCH_TASK = "Ensure the controller cache holds each verified artifact"


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    return make_sandbox("cuda", ["p40", "p40"], login="sudo")


@pytest.fixture(scope="module")
def sha256(fleet) -> str:
    vars_file = fleet.inventory_dir / "group_vars" / "p40_sandbox.yml"
    for line in vars_file.read_text().splitlines():
        if line.startswith("cudnn_tarball_sha256:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"cudnn_tarball_sha256 missing from {vars_file}")


def mirror_requests(fleet: Sandbox, method: str = "GET") -> int:
    """How many requests for the archive the sandbox mirror has answered so far."""
    logs = podman("logs", fleet.mirror_container, check=False)
    text = (logs.stdout + logs.stderr).decode(errors="replace")
    return sum(1 for line in text.splitlines() if f'"{method} /cudnn_tarball/{FILE_NAME}' in line)


def host_sha256(fleet: Sandbox, host: str, path: str) -> str | None:
    result = fleet.exec(host, f"sha256sum {path}")
    return result.stdout.split()[0] if result.returncode == 0 else None


def leftovers(fleet: Sandbox, host: str, directory: str) -> list[str]:
    result = fleet.exec(host, f"ls -A {directory} 2>/dev/null")
    return result.stdout.split()


def test_check_mode_reports_the_download_and_changes_nothing(fleet, run_playbook):
    dest = "/var/tmp/fetch-check/" + FILE_NAME
    before = mirror_requests(fleet)
    result = run_playbook(
        PLAYBOOK,
        fleet.inventory_dir,
        check=True,
        diff=True,
        extra_vars={"fetch_test_dest": dest, "artifact_fetch_source": "upstream"},
    )
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert result.stats[host]["changed"] > 0
        assert fleet.exec(host, "test -e /var/tmp/fetch-check").returncode == 1
    assert mirror_requests(fleet) == before  # check mode only asks HEAD


def test_upstream_source_fetches_verifies_and_replaces_a_wrong_copy(fleet, run_playbook, sha256):
    dest = "/var/tmp/fetch-upstream/" + FILE_NAME
    # node2 holds a wrong file under the final name (a truncated earlier download, say).
    fleet.exec("node2", f"mkdir -p /var/tmp/fetch-upstream && echo truncated > {dest}")
    extra = {"fetch_test_dest": dest, "artifact_fetch_source": "upstream"}
    result = run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=extra)
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert result.stats[host]["changed"] > 0
        assert host_sha256(fleet, host, dest) == sha256
        assert leftovers(fleet, host, "/var/tmp/fetch-upstream") == [FILE_NAME]

    again = run_playbook(PLAYBOOK, fleet.inventory_dir, extra_vars=extra, check=True, diff=True)
    assert again.rc == 0
    assert {h: again.stats[h]["changed"] for h in HOSTS} == {"node1": 0, "node2": 0}


def test_mirror_source_uses_the_upstream_file_name_under_the_mirror(fleet, run_playbook, sha256):
    dest = "/var/tmp/fetch-mirror/" + FILE_NAME
    before = mirror_requests(fleet)
    result = run_playbook(
        PLAYBOOK,
        fleet.inventory_dir,
        extra_vars={
            "fetch_test_dest": dest,
            # The real NVIDIA URL: unreachable here, so only the mirror can have served the file.
            "fetch_test_url": REAL_UPSTREAM_URL,
            "artifact_fetch_source": "mirror",
            "p40fleet_mirror_base_url": "{{ p40fleet_sandbox_mirror_url }}/cudnn_tarball/",
        },
    )
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert host_sha256(fleet, host, dest) == sha256
    assert mirror_requests(fleet) == before + len(HOSTS)


def controller_verifications(result) -> list[tuple[str, str]]:
    """(host, path) for each artifact the controller's downloader checked on a host's behalf (each check hashes the
    cached file or downloads it)."""
    return [
        (e["event_data"]["host"], item["path"])
        for e in result.events
        if e.get("event") in ("runner_on_ok", "runner_on_failed")
        and e["event_data"].get("task") == CONTROLLER_FETCH_TASK
        for item in e["event_data"]["res"]["results"]
    ]


def test_controller_source_downloads_and_verifies_once_for_the_fleet(fleet, run_playbook, sha256, tmp_path):
    cache = tmp_path / "controller-cache"
    cached = cache / "cudnn_tarball" / FILE_NAME
    before = mirror_requests(fleet)
    # The second run finds the file in the cache: the downloader hashes it, once for the fleet, and downloads nothing.
    for run, dest_dir in enumerate(("/var/tmp/fetch-controller", "/var/tmp/fetch-controller-again")):
        dest = f"{dest_dir}/{FILE_NAME}"
        result = run_playbook(
            PLAYBOOK,
            fleet.inventory_dir,
            extra_vars={
                "fetch_test_dest": dest,
                "artifact_fetch_source": "controller",
                "artifact_fetch_controller_cache_dir": str(cache),
            },
        )
        assert result.rc == 0, result.stdout
        assert hashlib.sha256(cached.read_bytes()).hexdigest() == sha256
        assert sorted(p.name for p in cached.parent.iterdir()) == [FILE_NAME]  # no temp files left
        for host in HOSTS:
            assert host_sha256(fleet, host, dest) == sha256
            assert result.stats[host]["changed"] > 0
        assert len(controller_verifications(result)) == 1, (run, controller_verifications(result))
        assert mirror_requests(fleet) == before + 1, run


def test_tampered_artifact_fails_and_leaves_nothing_under_the_final_name(fleet, run_playbook, sha256):
    dest = "/var/tmp/fetch-tampered/" + FILE_NAME
    wrong = hashlib.sha256(b"not the file the mirror serves").hexdigest()
    # node1 already has the genuine file: a pin that does not match it must not keep it either.
    fleet.exec("node1", f"mkdir -p /var/tmp/fetch-tampered && cp /var/tmp/fetch-upstream/{FILE_NAME} {dest}")
    result = run_playbook(
        PLAYBOOK,
        fleet.inventory_dir,
        extra_vars={"fetch_test_dest": dest, "fetch_test_sha256": wrong, "artifact_fetch_source": "upstream"},
    )
    assert result.rc != 0
    failed = {f.host: f.message for f in result.failures}
    assert set(failed) == set(HOSTS)
    for host in HOSTS:
        assert failed[host].startswith(f"{host}: fetching cudnn_tarball from http://"), failed[host]
        assert "did not match" in failed[host]
        assert f"Nothing was kept at {dest}" in failed[host]
        assert leftovers(fleet, host, "/var/tmp/fetch-tampered") == []


def test_a_cache_filled_by_p40fleet_fetch_serves_the_fleet_without_another_download(fleet, run_playbook, sha256):
    """`p40fleet fetch` writes the controller cache exactly where artifact_fetch's controller source reads it."""
    from p40fleet import cli

    before = mirror_requests(fleet)
    assert cli.main(["fetch", "-i", str(fleet.inventory_dir / "hosts.yml")]) == 0
    assert mirror_requests(fleet) == before + 1  # fetch downloaded the archive (and the other pinned artifacts)
    dest = "/var/tmp/fetch-prefilled/" + FILE_NAME
    # The sandbox inventory's own artifact_fetch_controller_cache_dir: the one p40fleet fetch just filled.
    result = run_playbook(
        PLAYBOOK, fleet.inventory_dir, extra_vars={"fetch_test_dest": dest, "artifact_fetch_source": "controller"}
    )
    assert result.rc == 0, result.stdout
    for host in HOSTS:
        assert host_sha256(fleet, host, dest) == sha256
    assert mirror_requests(fleet) == before + 1
