"""`p40fleet train` on sandbox hosts, for real: the train_run role's units under the stand-in service manager
(python/tests/fixtures/standins/host/systemd/), each running a stand-in for verl's trainer
(python/tests/fixtures/standins/trainer/verl_standin.py: verl's metric lines and checkpoints, no GPU) as the env
owner. Three hosts train one run each with a seed of their own; node2 is stopped and resumed from its checkpoint,
node3 is powered off and on under its run (the reboot is reported, then resumed); every run is followed to its end
in `status` and in the report (JSON and HTML). Fresh hosts: the env owner is made here, as conda_env would make it.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from p40fleet import cli, train
from p40fleet.state import StateDir
from p40fleet_dev.standins import TRAINER_ON_HOST, install_trainer

pytestmark = [pytest.mark.sandbox]

OWNER = "p40fleet"
STEPS = 60
# Read by the stand-in before each step (+standin.step_seconds_file): once every interruption was seen, the rest of
# each run goes at this pace, not three seconds a step, the wait on the runs' ends being no part of what is proven.
PACE = "/usr/local/libexec/p40fleet-standin/pace"
LOG = f"/home/{OWNER}/.p40fleet/train/gsm8k.log"
CHECKPOINTS = f"/home/{OWNER}/standin-checkpoints"
HOSTS = ("node1", "node2", "node3")


@pytest.fixture(scope="module")
def fleet(make_sandbox, tmp_path_factory):
    fleet = make_sandbox("train", ["p40", "p40", "p40"], services=True)
    for host in HOSTS:
        made = fleet.exec(host, f"useradd -m -s /bin/bash {OWNER}")
        assert made.returncode == 0, made.stderr
        # As `sandbox up --services` puts it there: root's, under a root-owned directory.
        install_trainer(fleet, host)
    command = ["/usr/bin/python3", TRAINER_ON_HOST, f"trainer.total_training_steps={STEPS}"]
    command += ["trainer.save_freq=4", "trainer.test_freq=4", "+standin.step_seconds=3"]
    command += [f"+standin.step_seconds_file={PACE}"]
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(json.dumps({"train_run_command": command}) + "\n")
    host_vars = fleet.inventory_dir / "host_vars"
    host_vars.mkdir(exist_ok=True)
    for seed, host in enumerate(HOSTS, start=1):
        (host_vars / f"{host}.yml").write_text(json.dumps({"train_run_overrides": [f"data.seed={seed}"]}) + "\n")
    fleet.state = StateDir(tmp_path_factory.mktemp("train-state"))
    fleet.train = lambda action, **kw: train.train(fleet.inventory_dir, action, state_dir=fleet.state, **kw)
    yield fleet
    fleet.down()


def step_of(fleet, host):
    """The last step in the run's log, read straight off the host (the test's own look, not the role's)."""
    steps = re.findall(r"^step:(\d+) ", fleet.exec(host, f"cat {LOG} 2>/dev/null").stdout, re.MULTILINE)
    return int(steps[-1]) if steps else 0


def wait_until(predicate, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1)


def by_host(result):
    assert result.run.rc == 0, result.run.failures
    return {r["host"]: r for r in result.runs}


def test_three_runs_start_as_the_owner_and_survive_the_play(fleet):
    runs = by_host(fleet.train("start"))
    assert {h: r["state"] for h, r in runs.items()} == {h: "running" for h in HOSTS}
    unit = fleet.exec("node1", "stat -c '%U %a' /etc/systemd/system/p40fleet-train-gsm8k.service").stdout.split()
    assert unit == ["root", "644"]
    wait_until(lambda: all(step_of(fleet, h) >= 1 for h in HOSTS))
    owners = fleet.exec("node1", "ps -o user= -o args= -C python3 | grep verl_standin").stdout
    assert owners.split()[0] == OWNER and "data.seed=1" in owners
    # Started again while running: left as it is, nothing changed.
    again = fleet.train("start")
    changed = [
        (e["event_data"].get("host"), e["event_data"].get("task"))
        for e in again.run.events
        if e.get("event") == "runner_on_ok" and (e["event_data"].get("res") or {}).get("changed")
    ]
    assert changed == []


def test_stop_one_then_resume_it_from_its_checkpoint(fleet):
    wait_until(lambda: step_of(fleet, "node2") >= 5)
    stopped = by_host(fleet.train("stop", limit="node2"))
    assert stopped["node2"]["state"] == "stopped" and stopped["node2"]["progress"]["checkpoint_step"] >= 4
    checkpoint = stopped["node2"]["progress"]["checkpoint_step"]
    at = step_of(fleet, "node2")
    time.sleep(5)
    assert step_of(fleet, "node2") == at  # really stopped
    resumed = by_host(fleet.train("start", limit="node2"))
    assert resumed["node2"]["state"] == "running"
    # The resumed run loads the stop's checkpoint and goes on from the step after it. (Whether that step was logged
    # before the stop depends on when the stop landed: a stop right after a save leaves it for the resumed run.)
    loaded = f"Load from checkpoint folder: {CHECKPOINTS}/global_step_{checkpoint}"
    wait_until(
        lambda: (
            re.search(
                rf"^.*{re.escape(loaded)}.*\n(.*\n)*?step:{checkpoint + 1} ",
                fleet.exec("node2", f"cat {LOG}").stdout,
                re.MULTILINE,
            )
            is not None
        )
    )


def test_a_reboot_under_a_run_is_reported_then_resumed(fleet):
    wait_until(lambda: step_of(fleet, "node3") >= 5)
    fleet.power_off("node3")
    fleet.power_on("node3")
    runs = by_host(fleet.train("status"))
    assert runs["node3"]["state"] == "rebooted"
    assert "node3 rebooted under the run (boot identity changed since its start)" in runs["node3"]["why"]
    assert fleet.train("status").run.rc == 0
    assert cli.main(["train", "status", "-i", str(fleet.inventory_dir), "--state-dir", str(fleet.state.root)]) == (
        cli.EXIT_HOSTS_FAILED
    )
    resumed = by_host(fleet.train("start", limit="node3"))
    assert resumed["node3"]["state"] == "running"


def test_every_run_is_followed_to_its_end_in_status_and_the_report(fleet, tmp_path):
    try:
        for host in HOSTS:
            fleet.exec(host, f"echo 0.05 > {PACE}")
        wait_until(lambda: all(step_of(fleet, h) >= STEPS for h in HOSTS), timeout=480)
    finally:
        for host in HOSTS:  # the cluster run below goes at the command's own pace
            fleet.exec(host, f"rm -f {PACE}")
    wait_until(lambda: all(r["state"] == "finished" for r in fleet.train("status").runs), timeout=60)
    runs = by_host(fleet.train("status"))
    for host in HOSTS:
        progress = runs[host]["progress"]
        assert progress["step"] == STEPS == progress["total_steps"] == progress["checkpoint_step"]
        assert progress["val_step"] == STEPS and 0 < progress["train_score"] <= 1
        assert [p[0] for p in progress["history"]] == list(range(1, STEPS + 1))
    # Seeds differ, so do the scores.
    assert len({runs[h]["progress"]["train_score"] for h in HOSTS}) == 3
    json_path, html_path = tmp_path / "report.json", tmp_path / "report.html"
    argv = ["report", "-i", str(fleet.inventory_dir), "--state-dir", str(fleet.state.root)]
    assert cli.main([*argv, "--json", str(json_path), "--html", str(html_path)]) == cli.EXIT_OK
    report = json.loads(json_path.read_text())
    assert {(r["host"], r["state"]) for r in report["runs"]} == {(h, "finished") for h in HOSTS}
    page = html_path.read_text()
    assert page.count("<svg ") == 3 and 'id="run-node2-gsm8k"' in page


def test_a_cluster_run_is_refused_before_cluster_yml_then_followed_to_its_end(fleet):
    """`p40fleet train start --cluster demo`: one run on the cluster's head, which the other members report. Before
    it starts, the network between the members is measured; these hosts have no Ray (no playbooks/cluster.yml formed
    demo), so start is refused on every member with what to do, and nothing starts. Without the check the head runs
    the job. Its command is the stand-in trainer (train_run_command) standing in for p40fleet-ray-submit: Ray's side
    is test_ray_cluster.py's (a cluster job through real Ray, the network measured), the measurement's
    test_ray_cluster_network.py's."""
    host_vars = fleet.inventory_dir / "host_vars"
    for host in HOSTS:
        path = host_vars / f"{host}.yml"
        path.write_text(json.dumps({**json.loads(path.read_text()), "p40fleet_cluster": "demo"}) + "\n")
    steps = ["trainer.total_training_steps=8", f"trainer.default_local_dir=/home/{OWNER}/cluster-checkpoints"]
    job = {"train_run_cluster": "demo", "train_run_name": "cluster", "train_run_overrides": steps}
    refused = fleet.train("start", extra_vars=job)
    assert refused.run.rc != 0
    messages = {f.host: f.message for f in refused.run.failures}
    assert set(messages) == set(HOSTS), messages
    assert (
        "node1: cluster demo: /etc/p40fleet/ray/ray.env names another cluster or none on node1 (none), node2 (none), "
        "node3 (none): run playbooks/cluster.yml first. The all-reduce measured nothing"
    ) in messages["node1"]
    assert fleet.exec("node1", "test -e /etc/systemd/system/p40fleet-train-cluster.service").returncode == 1
    started = by_host(fleet.train("start", extra_vars={**job, "train_run_network_check": False}))
    assert (started["node1"]["state"], started["node1"]["runs_here"], started["node1"]["network"]) == (
        "running",
        True,
        {},
    )
    assert {h: started[h]["state"] for h in ("node2", "node3")} == {"node2": "member", "node3": "member"}
    assert fleet.exec("node2", "test -e /etc/systemd/system/p40fleet-train-cluster.service").returncode == 1
    wait_until(lambda: by_host(fleet.train("status", extra_vars=job))["node1"]["state"] == "finished", timeout=300)
    runs = by_host(fleet.train("status", extra_vars=job))
    progress = runs["node1"]["progress"]
    assert progress["step"] == 8 == progress["total_steps"] == progress["checkpoint_step"]
    assert runs["node2"]["why"] == "the run is the cluster job of node1"
