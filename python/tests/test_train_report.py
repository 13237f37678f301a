"""`p40fleet train`'s side of the controller, from data: runs taken from the hosts' published status (synthetic
ansible-runner events shaped like roles/train_run's train_run_status), kept in the state directory over earlier
ones, shown in the terminal and in the report (JSON, and HTML with an inline SVG per run, looked at in headless
Chromium at 3 and at 100 hosts). Every field came from a host: markup and control characters must not get through."""

from __future__ import annotations

import json
import math
import random

import pytest
import yaml
from rich.console import Console

from p40fleet import cli, html_runs, train
from p40fleet.state import StateDir

from .conftest import TEST_OUTPUT
from .test_fleet_report import CHROMIUM, _png_size, screenshot


def status(host, state="running", step=40, total=100, seed=1, name="gsm8k"):
    rng = random.Random(seed)
    history = [
        [s, round(0.1 + 0.6 * (1 - math.exp(-s / 30)) + rng.uniform(-0.03, 0.03), 3), None] for s in range(1, step + 1)
    ]
    for point in history:
        if point[0] % 10 == 0:
            point[2] = round(point[1] - 0.05, 3)
    return {
        "host": host,
        "name": name,
        "cluster": "",
        "head": host,
        "runs_here": True,
        "started": "2026-12-05T10:00:00+00:00",
        "log": f"/home/p40fleet/.p40fleet/train/{name}.log",
        "state": state,
        "why": {"rebooted": f"{host} rebooted under the run", "failed": "the run ended", "stopped": "stopped"}.get(
            state, ""
        ),
        "progress": {
            "step": step,
            "total_steps": total,
            "seconds_per_step": 31.5,
            "train_score": history[-1][1],
            "val_score": 0.41,
            "val_step": step // 10 * 10,
            "checkpoint_step": step // 20 * 20,
            "remaining_s": (total - step) * 31.5,
            "expected_end": 1_796_000_000,
            "history": history,
            "skipped": 0,
        },
    }


def event(run):
    return {
        "event": "runner_on_ok",
        "event_data": {"host": run["host"], "res": {"ansible_facts": {"train_run_status": run}}},
    }


def test_statuses_are_taken_from_the_published_facts_last_one_wins():
    old, new = status("node1", step=3), status("node1", step=9)
    other = {"event": "runner_on_ok", "event_data": {"res": {"ansible_facts": {"something": 1}}}}
    assert train.statuses([event(old), other, event(new), event(status("node0"))]) == [status("node0"), new]


def test_saved_runs_keep_the_latest_per_host_and_name(tmp_path):
    state, inventory = StateDir(tmp_path / "state"), tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    train.save_runs(state, inventory, [status("a"), status("b", step=5)], "t1")
    train.save_runs(state, inventory, [status("b", step=7), status("b", name="lr2")], "t2")
    runs = {(r["host"], r["name"]): r for r in train.saved_runs(state, inventory)}
    assert set(runs) == {("a", "gsm8k"), ("b", "gsm8k"), ("b", "lr2")}
    assert runs[("a", "gsm8k")]["seen"] == "t1" and runs[("b", "gsm8k")]["progress"]["step"] == 7


def test_the_terminal_table_strips_what_a_host_could_forge():
    forged = status("node1", state="failed")
    forged["name"] = "gsm8k\x1b[2J"
    forged["why"] = "ended\x1b]0;owned\x07 at step 3"
    console = Console(record=True, width=200, force_terminal=False)
    train.print_runs(console, [forged, status("node2")])
    text = console.export_text()
    assert "\x1b" not in text and "\x07" not in text
    assert "node1: ended]0;owned at step 3" in text
    assert "step 40 of 100" in text and "s/step 31.5" in text and "val score 0.410 @40" in text


def test_html_escapes_and_plots_only_numbers():
    forged = status("node1", state="failed")
    forged["name"] = "<script>x</script>"
    forged["why"] = "<img src=x onerror=alert(1)>"
    forged["progress"]["history"] = [[1, 0.2, None], ["2", "<b>", None], [3, float("nan"), 0.5], [4, 0.9, None], "x"]
    page = html_runs.render_runs([forged])
    assert "<script>" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
    assert page.count("<circle ") == 1 and page.count("<polyline ") == 1
    assert html_runs.render_runs([]) == ""
    assert "no steps yet" in html_runs.plot([])


# What roles/ray_cluster's network measurement keeps in a cluster run's record (plugins/filter/ray_cluster_network.py).
SLOW = {
    "cluster": "rack-a",
    "members": ["node001", "node002"],
    "world": 2,
    "verdict": "warn",
    "busbw_gbps": 0.9,
    "message": "cluster rack-a: all-reduce of 1.98 GB (nccl, 2 members): 2.200 s, algbw 0.90 GB/s, busbw 0.90 "
    "GB/s. A cluster job would be slower than independent runs on the same hosts: a step's 15.8 GB of gradients "
    "take about 400 s, more than the 300 s a step saves on 2 hosts",
}


def cluster_run(network):
    return {**status("node001"), "cluster": "rack-a", "network": network}


def test_the_network_measured_before_a_cluster_job_is_shown_with_its_verdict():
    forged = cluster_run({"verdict": "<b>", "message": "slow\x1b[2J <img src=x onerror=alert(1)>"})
    console = Console(record=True, width=400, force_terminal=False)
    train.print_runs(console, [cluster_run(SLOW), forged, status("node003")])
    text = console.export_text()
    assert "network warn: cluster rack-a: all-reduce of 1.98 GB" in text and "slower than independent runs" in text
    assert "network error: slow[2J <img src=x onerror=alert(1)>" in text and "\x1b" not in text
    assert text.count("network ") == 2
    page = html_runs.render_runs([cluster_run(SLOW), forged, status("node003")])
    assert '<div class="net net-warn">network warn: cluster rack-a' in page
    assert '<div class="net net-error">network error: slow[2J &lt;img' in page and "<img" not in page
    assert page.count('class="net ') == 2


@pytest.mark.parametrize("hosts", [3, 100])
def test_the_report_with_runs_in_a_browser(tmp_path, hosts):
    inventory = tmp_path / "hosts.yml"
    names = [f"node{i:03d}" for i in range(1, hosts + 1)]
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {name: {} for name in names}}}}}))
    state = StateDir(tmp_path / "state")
    states = ("running", "finished", "stopped", "rebooted", "failed")
    runs = [status(n, state=states[i % len(states)], step=20 + (i * 7) % 80, seed=i) for i, n in enumerate(names)]
    runs[0] = {**runs[0], "cluster": "rack-a", "network": SLOW}
    train.save_runs(state, inventory, runs, "2026-12-05T12:00:00+00:00")
    out = TEST_OUTPUT
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / f"report-runs-{hosts}.json", out / f"report-runs-{hosts}.html"
    argv = ["report", "-i", str(inventory), "--state-dir", str(state.root)]
    assert cli.main([*argv, "--json", str(json_path), "--html", str(html_path)]) == cli.EXIT_OK
    data = json.loads(json_path.read_text())
    assert [r["host"] for r in data["runs"]] == names
    assert data["runs"][0]["network"]["verdict"] == "warn"
    page = html_path.read_text()
    assert page.count("<svg ") == hosts and f"training runs ({hosts})" in page
    assert page.count('<div class="net net-warn">network warn: cluster rack-a') == 1
    assert "<script" not in page and "<img" not in page
    if CHROMIUM is None:
        pytest.skip("chromium is not installed: run `make test-deps`")
    height = 1700 if hosts == 3 else 6000
    png = screenshot(html_path, out / f"report-runs-{hosts}.png", height=height)
    assert _png_size(png) == (1400, height)
    assert png.stat().st_size > 50_000
    print(f"screenshot: {png}")
