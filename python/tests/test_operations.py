"""`p40fleet run` and `report` against real sandbox hosts: one that passes preflight, one whose
driver is too old, one that is down. The summary, the exit codes, --retry-failed and the report
(JSON, HTML, screenshot) from real runs. One fleet for the file; preflight only, so fast."""

from __future__ import annotations

import json

import pytest

from p40fleet import cli
from p40fleet_dev.sandbox import Sandbox, podman

from .conftest import TEST_OUTPUT
from .test_fleet_report import CHROMIUM, screenshot

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def fleet(make_sandbox) -> Sandbox:
    return make_sandbox("ops", ["p40", "p40-driver-too-old", "p40x2"])


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ops-state")


@pytest.fixture(scope="module")
def preflight_playbook(tmp_path_factory):
    # Only the preflight stage: `site.yml --tags gpu_preflight` also runs the later stages' always-tagged
    # probes, and verl_patches' fails on a host where nothing is installed yet.
    path = tmp_path_factory.mktemp("ops-play") / "preflight.yml"
    path.write_text(
        "---\n- name: Run only the preflight stage\n  hosts: p40-hosts\n  gather_facts: false\n"
        "  roles:\n    - role: gpu_preflight\n"
    )
    return path


def run(fleet, state_dir, playbook, tmp_path, capsys, *extra) -> tuple[int, dict, str]:
    report = tmp_path / "report.json"
    report.unlink(missing_ok=True)
    argv = ["run", "-i", str(fleet.inventory_dir), "--state-dir", str(state_dir), "--playbook", str(playbook)]
    code = cli.main([*argv, "--report", str(report), *extra])
    return code, json.loads(report.read_text())["runs"][0], capsys.readouterr().err


def test_summary_exit_codes_retry_failed_and_the_report(fleet, state_dir, preflight_playbook, tmp_path, capsys):
    node3 = fleet.host("node3")
    podman("stop", "-t", "0", node3.container)
    try:
        code, first, err = run(fleet, state_dir, preflight_playbook, tmp_path, capsys)
        assert code == cli.EXIT_HOSTS_FAILED
        states = {h: e["state"] for h, e in first["hosts"].items()}
        # node1 passes; its first preflight records its state (changed), a later one finds it (ok).
        assert states == {"node1": states["node1"], "node2": "failed", "node3": "unreachable"}
        assert states["node1"] in ("ok", "changed")
        message = first["hosts"]["node2"]["failures"][0]["message"]
        assert message.startswith("gpu_preflight refused node2 (nothing was changed on it):\n- ")
        assert "found NVIDIA driver 470.256.02; required: >= 520.61.05" in message
        # Not a terminal: one line per host, every count, the whole first failure, nothing cut.
        lines = err.splitlines()
        node2 = next(line for line in lines if line.startswith("  node2: failed ok="))
        assert node2.endswith(" | ".join(message.splitlines()))
        node3_line = next(line for line in lines if line.startswith("  node3: unreachable ok="))
        assert node3_line.endswith(first["hosts"]["node3"]["failures"][0]["message"]) and "…" not in err
        assert any(line.startswith("run: node3 unreachable: [gpu_preflight]") for line in lines)

        # The report of what the hosts are, from that real run.
        out = TEST_OUTPUT
        out.mkdir(parents=True, exist_ok=True)
        html = out / "report-sandbox.html"
        argv = ["report", "-i", str(fleet.inventory_dir), "--state-dir", str(state_dir)]
        assert cli.main([*argv, "--json", str(out / "report-sandbox.json"), "--html", str(html)]) == cli.EXIT_OK
        hosts = {h["host"]: h for h in json.loads((out / "report-sandbox.json").read_text())["hosts"]}
        assert {h: r["status"] for h, r in hosts.items()} == {"node1": "ok", "node2": "failed", "node3": "unreachable"}
        assert (hosts["node1"]["gpu"], hosts["node1"]["profile"]) == ("1x Tesla P40", "pascal")
        assert hosts["node1"]["driver"] and hosts["node1"]["profile_reasons"]
        assert hosts["node2"]["first_failure"]["message"] == message
        assert hosts["node3"]["first_failure"]["unreachable"]
        assert "found NVIDIA driver 470.256.02" in html.read_text()
        if CHROMIUM is not None:
            print(f"screenshot: {screenshot(html, out / 'report-sandbox.png', height=1000)}")

        code, retried, _ = run(fleet, state_dir, preflight_playbook, tmp_path, capsys, "--retry-failed")
        assert code == cli.EXIT_HOSTS_FAILED
        assert (retried["limit"], sorted(retried["hosts"])) == ("node2,node3", ["node2", "node3"])

        # node2's driver is upgraded: retrying it alone (within -l) passes.
        fleet.set_profile("node2", "p40")
        code, node2, _ = run(fleet, state_dir, preflight_playbook, tmp_path, capsys, "--retry-failed", "-l", "node2")
        assert code == cli.EXIT_OK
        assert (node2["limit"], node2["hosts"]["node2"]["state"]) == ("node2", "changed")

        code, nothing, err = run(fleet, state_dir, preflight_playbook, tmp_path, capsys, "--retry-failed")
        assert code == cli.EXIT_OK and nothing["status"] == "nothing-to-retry" and nothing["run_id"] is None
        assert "had no failed or unreachable host: nothing to retry" in err

        code, down, _ = run(fleet, state_dir, preflight_playbook, tmp_path, capsys, "-l", "node1,node3")
        assert code == cli.EXIT_HOSTS_UNREACHABLE
        assert {h: e["state"] for h, e in down["hosts"].items()} == {"node1": "ok", "node3": "unreachable"}
    finally:
        # A restarted container gets another address: the fleet is not used again after this test.
        fleet.set_profile("node2", "p40-driver-too-old")


def test_retry_failed_without_a_previous_run_says_so(fleet, tmp_path, capsys):
    argv = ["run", "-i", str(fleet.inventory_dir), "--state-dir", str(tmp_path / "empty"), "--retry-failed"]
    assert cli.main(argv) == cli.EXIT_ERROR
    assert "--retry-failed: no previous run against" in capsys.readouterr().err
