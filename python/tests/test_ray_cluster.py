"""Ray clusters across sandbox hosts, for real: the verl lock's Ray in each host's env, started by the
ray_cluster role under the stand-in service manager (python/tests/fixtures/standins/host/systemd/: the
sandbox hosts have no systemd), over the sandbox network. CPU only: the GPUs Ray counts are the ones each
host's profile declares (--num-gpus), no GPU work runs.

One fleet of four P40 hosts through the whole pipeline (Ray comes with verl's lock), each a copy of conftest's
site_image: site_fleet's node1 as its two runs left it (this module is in site_fleet's work unit, after it), or,
run alone, the same variant built from a fresh host (p40fleet_dev.images). Disks as a converge left them, which
cluster.yml takes as it finds them (it reads no stage record; a copy's first site.yml run would re-verify every
stage, as on a host whose preflight state changed: test_converged_run.py's driver change); the copies log in as
an ordinary user with password-less sudo, where the image's converge logged in as root. node1 to node3 form
cluster `demo` (refused at first: verl cannot split the batch sizes across three ranks; then with derived
sizes), node4 joins later. The tests run in order and build on each other. `p40fleet train start --cluster demo`
runs a job on it: the stand-in trainer (python/tests/fixtures/standins/trainer/verl_standin.py) through the head's
submit command, after the network measurement with the CPU venv's real torch, which every host sees read-only.
"""

from __future__ import annotations

import json
import re
import shlex
import time

import pytest

from p40fleet import cli, train
from p40fleet.cluster import statuses
from p40fleet.state import StateDir
from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT
from tests.ray_ports import LOOPBACK, connect, connect_all, ipv6_addresses, listening, swap_in_trainer

# converge: run alone, the module's image takes a fresh host through the pipeline (minutes). In site_fleet's unit:
# its node1 is the image.
pytestmark = [pytest.mark.sandbox, pytest.mark.converge, pytest.mark.xdist_group("site-fleet")]

OWNER = "p40fleet"
# What Ray needs on a 2-core machine shared by four hosts: a small object store (the containers' /dev/shm is
# 64 MB; Ray then uses /tmp) and patience while four nodes start.
SANDBOX_VARS = "---\nray_cluster_object_store_memory: 100000000\nray_cluster_ready_timeout: 240\n"
# The env's torch is a stand-in (no torch.distributed): the network measurement runs with the CPU venv's real torch,
# which every host sees read-only where a venv of the host's own Python finds it.
CPU_SITE_ON_HOST = "/opt/p40fleet-standin/cpu-venv-site"
TORCH_VENV = "/opt/p40fleet-standin/torch"
STANDIN = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "trainer" / "verl_standin.py"
STANDIN_ON_HOST = "/opt/p40fleet-standin/verl_standin.py"


@pytest.fixture(scope="module")
def fleet(make_sandbox, run_playbook, site_image, tmp_path_factory):
    cpu_site = next(cpu_venv.python().parent.parent.glob("lib/python3*/site-packages")).resolve()
    fleet = make_sandbox(
        "ray", ["p40", "p40", "p40", "p40"], services=True, image=site_image, volumes={cpu_site: CPU_SITE_ON_HOST}
    )
    host_vars = fleet.inventory_dir / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(SANDBOX_VARS)
    fleet.join = lambda host, cluster="demo": (host_vars / f"{host}.yml").write_text(
        f"---\np40fleet_cluster: {cluster}\n"
    )
    fleet.leave = lambda host: (host_vars / f"{host}.yml").unlink()
    fleet.cluster = lambda **kw: run_playbook("playbooks/cluster.yml", fleet.inventory_dir, **kw)
    fleet.state = StateDir(tmp_path_factory.mktemp("ray-train-state"))
    fleet.train = lambda action, **kw: train.train(fleet.inventory_dir, action, state_dir=fleet.state, **kw)
    for host in ("node1", "node2", "node3"):
        fleet.join(host)
    yield fleet
    # Gone with the module, not at the end of the session: an idle Ray node keeps working (its dashboard's
    # processes poll; docs/benchmarks-code.md), and the tests that come after share the test machine.
    fleet.down()


def main_pid(fleet, host):
    return fleet.exec(host, "systemctl show -p MainPID --value p40fleet-ray").stdout.strip()


# What `ray list nodes` asks the head's state API (ray.util.state.api's list over /api/v0/nodes, on the head's
# loopback), asked with the host's own Python: the ray CLI imports Ray at each call, seconds of CPU a poll on the
# 2-core test machine.
STATE_API_NODES = (
    "import sys, urllib.request; "
    "answer = urllib.request.urlopen('http://127.0.0.1:8265/api/v0/nodes?limit=1000', timeout=30); "
    "sys.stdout.write(answer.read().decode())"
)


def alive_nodes(fleet):
    """{node name: GPUs} of the alive nodes, from Ray's state API on the head, as the env owner."""
    listing = fleet.exec("node1", f"/usr/bin/python3 -I -c {shlex.quote(STATE_API_NODES)}", user=OWNER)
    assert listing.returncode == 0, listing.stderr
    answer = json.loads(listing.stdout)
    assert answer["result"] is True, answer["msg"]
    return {
        n["node_name"]: n["resources_total"].get("GPU", 0)
        for n in answer["data"]["result"]["result"]
        if n["state"] == "ALIVE"
    }


def listening_addresses(fleet, host, port):
    """The addresses a TCP port listens on in a host (/proc/net/tcp: LISTEN is state 0A), the fleet's by name."""
    table = fleet.exec(host, "cat /proc/net/tcp").stdout.splitlines()[1:]
    found = set()
    for line in table:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            ip = ".".join(str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0))
            found.add(f"{host} fleet address" if ip == fleet.host(host).address else ip)
    return found


def wait_for(fleet, expected, timeout=180):
    deadline = time.monotonic() + timeout
    while True:
        try:
            found = alive_nodes(fleet)
        except AssertionError:
            found = None
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(2)


def test_three_members_are_refused_with_the_node_counts_that_work(fleet):
    """verl cannot split the launch script's 256 / mini 64 / micro 8 across three ranks: refused before any Ray node
    starts; with ray_cluster_batch_sizes: derive the plan trains with sizes that split (every later test)."""
    result = fleet.cluster()
    assert result.rc != 0
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1", "node2", "node3"}
    refusal = messages["node2"]
    assert "cluster demo (node1, node2, node3): 3 node(s) x 1 GPU(s) = 3 ranks, which verl cannot split" in refusal
    assert "ppo_mini_batch_size 64 // 3 ranks = 21, not a multiple of ppo_micro_batch_size_per_gpu 8" in refusal
    assert "Node counts of 1 GPU(s) that train with these batch sizes: 1 (1 ranks), 2 (2 ranks), 4 (4 ranks)" in refusal
    for host in ("node1", "node2", "node3"):
        assert fleet.exec(host, "test -e /etc/systemd/system/p40fleet-ray.service").returncode == 1
    # A launch environment that sets what verl's ray.init sets is refused before anything starts, too.
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(SANDBOX_VARS + "ray_cluster_batch_sizes: derive\n")
    collided = fleet.cluster(extra_vars={"launch_script_environment": {"NCCL_DEBUG": "INFO"}})
    assert collided.rc != 0
    assert "launch_script_environment sets NCCL_DEBUG: verl's own ray.init sets NCCL_DEBUG=WARN" in (
        collided.host_failures("node1")[0].message
    )
    assert fleet.exec("node1", "test -e /etc/systemd/system/p40fleet-ray.service").returncode == 1


def test_three_hosts_form_a_cluster(fleet):
    result = fleet.cluster()
    assert result.rc == 0, result.failures
    shown = fleet.exec("node1", "cd && p40fleet-ray-submit --print", user=OWNER).stdout
    assert " data.train_batch_size=288 " in shown and " actor_rollout_ref.actor.ppo_mini_batch_size=72 " in shown
    assert alive_nodes(fleet) == {"node1": 1.0, "node2": 1.0, "node3": 1.0}
    env = fleet.exec("node2", "cat /etc/p40fleet/ray/ray.env; stat -c '%U %a' /etc/p40fleet/ray/ray.env").stdout
    assert "P40FLEET_RAY_ROLE=worker" in env and "NCCL_SOCKET_IFNAME=eth0" in env and "GLOO_SOCKET_IFNAME=eth0" in env
    assert env.strip().endswith("root 644")
    # Ray runs as the env owner, never as root; its dashboard is bound to the head's loopback, not every interface.
    owners = fleet.exec("node1", "ps -o user= -C gcs_server,raylet | sort -u").stdout
    assert owners.split() == [OWNER]
    assert listening_addresses(fleet, "node1", 8265) == {"127.0.0.1"}
    # Ray's temp directory is in the owner's private one, not the shared /tmp/ray; p40fleet's firewall is loaded.
    private = fleet.exec("node2", f"stat -c '%U %a' ~{OWNER}/.p40fleet-ray; test ! -e /tmp/ray").stdout
    assert private.split() == [OWNER, "700"]
    assert fleet.exec("node2", "nft list table inet p40fleet_ray").returncode == 0


def test_a_checkpoint_directory_that_is_not_shared_is_refused(fleet):
    """The sandbox's hosts share no filesystem: the nonce node1 writes is not there on the others."""
    before = {h: main_pid(fleet, h) for h in ("node1", "node2", "node3")}
    result = fleet.cluster(extra_vars={"ray_cluster_checkpoint_dir": "/srv/p40fleet-checkpoints"})
    assert result.rc != 0
    assert {f.host for f in result.failures} == {"node1", "node2", "node3"}
    assert (
        "cluster demo: ray_cluster_checkpoint_dir /srv/p40fleet-checkpoints is not one filesystem on every member: "
        "node2, node3 do(es) not see the file node1 wrote there"
    ) in result.host_failures("node1")[0].message
    made = fleet.exec("node1", "stat -c '%U %a' /srv/p40fleet-checkpoints/.p40fleet-shared").stdout.split()
    assert made == ["root", "755"]
    assert fleet.exec("node1", "test -e /srv/p40fleet-checkpoints/demo").returncode == 1
    assert {h: main_pid(fleet, h) for h in before} == before
    for host in ("node1", "node2", "node3"):
        fleet.exec(host, "rm -rf /srv/p40fleet-checkpoints")


def test_status_lists_the_three_nodes(fleet, run_playbook):
    result = run_playbook("playbooks/cluster_status.yml", fleet.inventory_dir)
    assert result.rc == 0, result.failures
    status = statuses(result.events)["demo"]
    assert [(m["name"], m["alive"], m["gpus"], m["head"]) for m in status["members"]] == [
        ("node1", True, 1.0, True),
        ("node2", True, 1.0, False),
        ("node3", True, 1.0, False),
    ]
    assert status["gpus"] == 3 and status["gpus_wanted"] == 3 and status["strays"] == [] and status["error"] == ""


def test_a_job_through_the_launch_path_reaches_every_node(fleet, run_playbook):
    submitted = fleet.exec("node1", "cd && p40fleet-ray-submit --nodes", user=OWNER)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    ran = dict(
        re.findall(
            r"^p40fleet-node (\S+) ran on (\S+) NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0$",
            submitted.stdout,
            re.MULTILINE,
        )
    )
    assert ran == {"node1": "node1", "node2": "node2", "node3": "node3"}, submitted.stdout
    job = re.search(r"^p40fleet-ray-submit: job (p40fleet-nodes-\S+) on ", submitted.stdout, re.MULTILINE).group(1)
    record = fleet.exec("node1", "cat ~/.p40fleet/ray-jobs/jobs.log", user=OWNER).stdout
    assert f"{job} SUCCEEDED" in record
    status = statuses(run_playbook("playbooks/cluster_status.yml", fleet.inventory_dir).events)["demo"]
    assert status["last_job"]["id"] == job and status["last_job"]["status"] == "SUCCEEDED"


def test_a_cluster_job_started_by_p40fleet_train_runs_on_ray_to_its_end(fleet, tmp_path):
    """`p40fleet train start --cluster demo` on the formed cluster: the members' network is measured first (gloo, the
    CPU venv's torch), then the head's unit runs p40fleet-ray-submit, which submits the job to the cluster's Ray and
    follows it. The trainer is the stand-in (verl needs a GPU): the job runs a copy of the head's rendered submit
    command in which the stand-in's file takes the place of `-m verl.trainer.main_ppo`, every other line as
    playbooks/cluster.yml wrote it. `status` follows the job's metric lines, as `ray job submit` relays them, to its
    last step and checkpoint; the report shows the network measured."""
    venv = f"/usr/bin/python3 -m venv --without-pip {TORCH_VENV}"
    found = f"echo {CPU_SITE_ON_HOST} > $(echo {TORCH_VENV}/lib/python3*/site-packages)/cpu-venv.pth"
    for host in ("node1", "node2", "node3"):
        made = fleet.exec(host, f"{venv} && {found}")
        assert made.returncode == 0, made.stderr
    submit = "/usr/local/bin/p40fleet-ray-submit"
    standin_submit = "/opt/p40fleet-standin/p40fleet-ray-submit"
    files = {STANDIN_ON_HOST: STANDIN.read_bytes()}
    assert swap_in_trainer(fleet, "node1", files, submit, STANDIN_ON_HOST, copy=standin_submit) == 1
    # Two seconds a step: the job is still running when start reads its status.
    steps = ["trainer.total_training_steps=6", "trainer.save_freq=3", "trainer.test_freq=3", "+standin.step_seconds=2"]
    job = {
        "train_run_cluster": "demo",
        "train_run_name": "cluster",
        "train_run_overrides": steps,
        "train_run_submit_script": standin_submit,
    }
    network = {
        "ray_cluster_network_python": f"{TORCH_VENV}/bin/python",
        "ray_cluster_network_backend": "gloo",
        "ray_cluster_network_bytes": 4000000,
        "ray_cluster_network_timeout": 120,
    }
    started = fleet.train("start", extra_vars={**job, **network})
    assert started.run.rc == 0, started.run.failures
    runs = {r["host"]: r for r in started.runs}
    assert (runs["node1"]["state"], runs["node1"]["runs_here"]) == ("running", True), runs["node1"]
    measured = runs["node1"]["network"]
    assert (measured["backend"], measured["world"], measured["members"]) == ("gloo", 3, ["node1", "node2", "node3"])
    assert measured["verdict"] in ("pass", "warn", "fail"), measured
    assert "cluster demo: all-reduce of 0.00 GB (gloo, 3 members)" in measured["message"]
    assert {runs[h]["state"] for h in ("node2", "node3")} == {"member"}

    deadline = time.monotonic() + 300
    while (status := {r["host"]: r for r in fleet.train("status", extra_vars=job).runs})["node1"]["state"] == "running":
        assert time.monotonic() < deadline, status["node1"]
        time.sleep(3)
    head = status["node1"]
    assert head["state"] == "finished", head
    progress = head["progress"]
    assert progress["step"] == 6 == progress["total_steps"] == progress["checkpoint_step"], progress
    assert progress["val_step"] == 6 and head["network"] == measured
    # The stand-in's checkpoint is on the head's disk where verl's default_local_dir puts it.
    log = fleet.exec("node1", f"cat {head['log']}", user=OWNER).stdout
    folder = re.findall(r"^local_global_step_folder: (\S+)$", log, re.MULTILINE)[-1]
    assert folder.endswith("/global_step_6") and fleet.exec("node1", f"test -d {folder}/actor").returncode == 0
    # The job ran on Ray: submitted, recorded and ended as the submit command records it.
    record = fleet.exec("node1", "cat ~/.p40fleet/ray-jobs/jobs.log", user=OWNER).stdout
    job_id = re.findall(r"^\S+ (p40fleet-train-\S+) submitted$", record, re.MULTILINE)[-1]
    assert f"{job_id} SUCCEEDED" in record
    json_path, html_path = tmp_path / "report.json", tmp_path / "report.html"
    argv = ["report", "-i", str(fleet.inventory_dir), "--state-dir", str(fleet.state.root)]
    assert cli.main([*argv, "--json", str(json_path), "--html", str(html_path)]) == cli.EXIT_OK
    reported = {r["host"]: r for r in json.loads(json_path.read_text())["runs"]}
    assert reported["node1"]["network"] == measured and reported["node1"]["state"] == "finished"
    assert f"network {measured['verdict']}: cluster demo: all-reduce of 0.00 GB (gloo, 3 members)" in (
        html_path.read_text()
    )


def test_another_account_and_a_stranger_cannot_reach_ray(fleet):
    """A job submitted from another local account and a node that is no member are refused."""
    made = fleet.exec("node1", "id intruder >/dev/null 2>&1 || useradd -m intruder")
    assert made.returncode == 0, made.stderr
    head = fleet.host("node1").address
    # The dashboard's job API and the GCS, from another account on the head and on a member; the owner gets through.
    assert connect(fleet, "node1", "127.0.0.1", 8265, user="intruder") == "refused"
    assert connect(fleet, "node1", head, 6379, user="intruder") == "refused"
    assert connect(fleet, "node1", "127.0.0.1", 8265, user=OWNER) == "connected"
    assert connect(fleet, "node2", head, 6379, user=OWNER) == "connected"
    # node4 is no member yet: even as root it reaches no port a member's Ray listens on, over IPv4 or IPv6.
    uid = fleet.exec("node1", f"id -u {OWNER}").stdout.strip()
    for member in ("node1", "node2", "node3"):
        ports = sorted({port for address, port in listening(fleet, member, uid) if address not in LOOPBACK})
        assert {6380, 6381, 52365} <= set(ports), (member, ports)
        addresses = [fleet.host(member).address, *ipv6_addresses(fleet, member)]
        assert len(addresses) > 1, f"{member} has no IPv6 address on eth0 to knock on"
        knocks = connect_all(fleet, "node4", [(address, port) for port in ports for address in addresses])
        assert set(knocks.values()) == {"refused"}, (member, knocks)
    # The submit command is the owner's alone.
    refused = fleet.exec("node1", "p40fleet-ray-submit --nodes", user="intruder")
    assert refused.returncode != 0 and "ray-jobs" not in refused.stdout


def test_a_rerun_changes_nothing(fleet):
    before = {h: main_pid(fleet, h) for h in ("node1", "node2", "node3")}
    result = fleet.cluster()
    assert result.rc == 0, result.failures
    assert {h: s["changed"] for h, s in result.stats.items()} == {f"node{i}": 0 for i in range(1, 5)}
    assert {h: main_pid(fleet, h) for h in before} == before


def restarts(fleet, host):
    shown = fleet.exec(host, "systemctl show -p NRestarts --value p40fleet-ray").stdout.strip()
    return int(shown or 0)


def test_a_killed_raylet_is_restarted_and_rejoins(fleet):
    # Counted from now: on a loaded machine a node may have been restarted once already (a join that timed out).
    before, restarted = main_pid(fleet, "node2"), restarts(fleet, "node2")
    killed = fleet.exec("node2", "kill -9 $(pgrep -u p40fleet -x raylet)")
    assert killed.returncode == 0, killed.stderr
    # `ray start --block` sees its raylet gone and exits 1; Restart=on-failure starts it again after RestartSec.
    deadline = time.monotonic() + 60
    shown = ""
    while time.monotonic() < deadline and not (
        f"NRestarts={restarted + 1}" in shown and "ActiveState=active" in shown and main_pid(fleet, "node2") != before
    ):
        time.sleep(1)
        shown = fleet.exec("node2", "systemctl show -p NRestarts -p ActiveState p40fleet-ray").stdout
    assert f"NRestarts={restarted + 1}" in shown and "ActiveState=active" in shown, shown
    assert main_pid(fleet, "node2") not in (before, "0")
    assert wait_for(fleet, {"node1": 1.0, "node2": 1.0, "node3": 1.0}) == {"node1": 1.0, "node2": 1.0, "node3": 1.0}


def test_a_host_powered_off_and_on_rejoins(fleet):
    fleet.power_off("node3")
    assert wait_for(fleet, {"node1": 1.0, "node2": 1.0}, timeout=120) == {"node1": 1.0, "node2": 1.0}
    before = fleet.host("node3").address
    fleet.power_on("node3")
    # podman hands the container another address, as a DHCP lease may: the members' firewalls admit Ray's ports from
    # the addresses of the last cluster.yml run, so the operator runs it again (docs/cluster-network.md).
    if fleet.host("node3").address != before:
        result = fleet.cluster()
        assert result.rc == 0, result.failures
    assert wait_for(fleet, {"node1": 1.0, "node2": 1.0, "node3": 1.0}) == {"node1": 1.0, "node2": 1.0, "node3": 1.0}


def test_a_fourth_host_joins_without_restarting_the_others(fleet):
    before = {h: main_pid(fleet, h) for h in ("node1", "node2", "node3")}
    fleet.join("node4")
    result = fleet.cluster()
    assert result.rc == 0, result.failures
    assert alive_nodes(fleet) == {"node1": 1.0, "node2": 1.0, "node3": 1.0, "node4": 1.0}
    assert {h: main_pid(fleet, h) for h in before} == before


def test_a_removed_member_leaves(fleet):
    fleet.leave("node4")
    result = fleet.cluster()
    assert result.rc == 0, result.failures
    assert wait_for(fleet, {"node1": 1.0, "node2": 1.0, "node3": 1.0}, timeout=90) == {
        "node1": 1.0,
        "node2": 1.0,
        "node3": 1.0,
    }
    assert fleet.exec("node4", "test -e /etc/systemd/system/p40fleet-ray.service").returncode == 1
    assert fleet.exec("node4", "pgrep -u p40fleet raylet").returncode == 1
    # It trains alone from now on: p40fleet's table stays, without members, for the launch script's own Ray.
    table = fleet.exec("node4", "nft list table inet p40fleet_ray")
    assert table.returncode == 0 and "members" not in table.stdout and "6390" in table.stdout, table.stdout


def test_a_mixed_cluster_is_refused_with_its_reason(fleet):
    before = {h: main_pid(fleet, h) for h in ("node1", "node2", "node3")}
    fleet.set_profile("node4", "p40x2")
    fleet.join("node4")
    result = fleet.cluster()
    assert result.rc != 0
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1", "node2", "node3", "node4"}
    assert "cluster demo: mixed GPU profiles (" in messages["node1"]
    assert "node4: 2x Tesla P40" in messages["node1"]
    assert {h: main_pid(fleet, h) for h in before} == before
    fleet.leave("node4")
    fleet.set_profile("node4", "p40")
