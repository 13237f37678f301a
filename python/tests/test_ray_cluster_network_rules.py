"""The network measurement's decisions (plugins/filter/ray_cluster_network.py), table-tested without hosts: who takes
which rank and where the members meet, read from each member's root-owned ray.env; the members' outputs parsed
strictly as data; the bandwidths the nccl-tests way and the verdict. Last, the role's own all-reduce script
(owner_scripts/network_allreduce.py) run as two ranks on this machine with the hosts' torch (the CPU venv,
gloo over loopback), its lines judged by the same filter."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import yaml

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster_network.py", "ray_cluster_network_filter")
SCRIPT = REPO_ROOT / "owner_scripts" / "network_allreduce.py"
DEFAULTS = yaml.safe_load((REPO_ROOT / "roles" / "ray_cluster" / "defaults" / "main.yml").read_text())
INVENTORY = [{"host": h, "cluster": c} for h, c in (("a", "c1"), ("b", "c1"), ("x", ""), ("c", "c1"), ("d", "c2"))]
GB = 1e9


def env(role="worker", head="10.0.0.2:6379", cluster="c1", gpus="1", iface="eth1"):
    return {
        "P40FLEET_RAY_CLUSTER": cluster,
        "P40FLEET_RAY_ROLE": role,
        "P40FLEET_RAY_HEAD_ADDRESS": head,
        "P40FLEET_RAY_NUM_GPUS": gpus,
        "NCCL_SOCKET_IFNAME": iface,
    }


# b is the head (p40fleet_cluster_head: b): rank 0, then a and c in inventory order.
FOUND = {"a": env(), "b": env("head"), "c": env(), "d": env("head", "10.0.0.9:6379", "c2")}


def plan_for(host, found=FOUND, backend="auto"):
    return RULES.ray_cluster_network_plan(INVENTORY, "c1", found, host, backend, 6385)


@pytest.mark.parametrize(("host", "rank"), [("b", 0), ("a", 1), ("c", 2)])
def test_the_head_is_rank_zero_and_the_meeting_point(host, rank):
    plan = plan_for(host)
    assert plan["error"] == ""
    assert (plan["rank"], plan["world"], plan["head"], plan["address"], plan["port"]) == (
        rank,
        3,
        "b",
        "10.0.0.2",
        6385,
    )
    assert (plan["iface"], plan["backend"], plan["measure"]) == ("eth1", "nccl", True)


@pytest.mark.parametrize(
    ("found", "backend", "error"),
    [
        ({k: v for k, v in FOUND.items() if k != "c"}, "auto", "member(s) c are not in this run"),
        ({**FOUND, "c": {}}, "auto", "names another cluster or none on c (none): run playbooks/cluster.yml first"),
        ({**FOUND, "c": env(cluster="c2")}, "auto", "on c (c2)"),
        ({**FOUND, "c": env("head")}, "auto", "disagree on the head (head role on b, c"),
        ({**FOUND, "c": env(head="10.0.0.3:6379")}, "auto", "head addresses 10.0.0.2:6379, 10.0.0.3:6379"),
        ({k: env("head" if k == "b" else "worker", "gpu01:6379") for k in "abc"}, "auto", "is no IPv4 address"),
        ({**FOUND, "a": env(iface="eth1; rm -rf /")}, "auto", "NCCL_SOCKET_IFNAME='eth1; rm -rf /'"),
        (FOUND, "mpi", "ray_cluster_network_backend is 'mpi': set auto, gloo or nccl"),
    ],
)
def test_members_that_cannot_meet_are_refused_naming_the_host_and_what_to_do(found, backend, error):
    plan = plan_for("a", found, backend)
    assert plan["error"].startswith("a: cluster c1: ") and error in plan["error"], plan["error"]
    assert plan["error"].endswith("The all-reduce measured nothing")


@pytest.mark.parametrize(
    ("found", "skipped"),
    [
        # qualify before the first playbooks/cluster.yml: no member's ray.env names the cluster.
        ({"a": {}, "b": {}, "c": env(cluster="c2")}, True),
        # Formed on one member only: that is a cluster in a bad state, refused as without skip.
        ({**FOUND, "c": {}}, False),
    ],
)
def test_qualify_skips_a_cluster_not_formed_yet(found, skipped):
    plan = RULES.ray_cluster_network_plan(INVENTORY, "c1", found, "a", "auto", 6385, "skip")
    assert (plan["measure"], bool(plan["skipped"]), bool(plan["error"])) == (False, skipped, not skipped)
    if skipped:
        result = RULES.ray_cluster_network_result({}, plan, SETTINGS)
        assert result["verdict"] == "skip" and "not formed yet" in result["message"]
        assert result["message"].endswith("run playbooks/cluster.yml, then qualify again")
    assert plan_for("a", found)["error"], "without skip, an unformed cluster is refused"


FIREWALL = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_firewall_rules")


@pytest.mark.parametrize(
    ("ports", "admitted"),
    [
        ([6379, [6380, 6385], [10002, 10999]], True),  # the role's default ports, merged into one span
        ([6385], True),
        ([6379, [6380, 6384], [10002, 10999]], False),  # a firewall written before the port joined it
    ],
)
def test_the_heads_firewall_must_name_the_meeting_port(ports, admitted):
    firewalls = {"b": FIREWALL.ray_cluster_firewall(["10.0.0.1", "10.0.0.2"], ports, 4242), "a": ""}
    plan = RULES.ray_cluster_network_plan(INVENTORY, "c1", FOUND, "a", "auto", 6385, "fail", firewalls)
    assert plan["error"] == (
        ""
        if admitted
        else (
            "a: cluster c1: the firewall of the head b (/etc/p40fleet/ray/firewall.nft) does not name port 6385 "
            "among the ports only members may reach: run playbooks/cluster.yml, which adds it. The all-reduce "
            "measured nothing"
        )
    )


def test_no_firewall_file_on_the_head_is_refused():
    plan = RULES.ray_cluster_network_plan(INVENTORY, "c1", FOUND, "a", "auto", 6385, "fail", {"a": "", "c": ""})
    assert "the firewall of the head b" in plan["error"]


@pytest.mark.parametrize(("forks", "refused"), [(None, False), (3, False), (20, False), (2, True)])
def test_a_cluster_larger_than_ansible_s_forks_is_refused_before_any_member_waits(forks, refused):
    plan = RULES.ray_cluster_network_plan(INVENTORY, "c1", FOUND, "a", "auto", 6385, "fail", None, forks)
    assert plan["error"] == (
        "a: cluster c1: its 3 members are more than Ansible runs at once (forks 2), and the all-reduce needs every "
        "member at once: run with --forks 3 or more (ansible.cfg: forks). The all-reduce measured nothing"
        if refused
        else ""
    )


def test_a_host_of_no_cluster_is_refused():
    assert "x is no member (members: a, b, c)" in plan_for("x")["error"]


@pytest.mark.parametrize(
    ("gpus", "backend", "want"),
    [
        (["1", "1", "1"], "auto", "nccl"),
        (["1", "0", "1"], "auto", "gloo"),  # the sandbox: CPU-only members
        (["2", "2", "2"], "gloo", "gloo"),
        (["0", "0", "0"], "nccl", "nccl"),
    ],
)
def test_backend(gpus, backend, want):
    found = {h: env("head" if h == "b" else "worker", gpus=g) for h, g in zip("abc", gpus, strict=True)}
    assert plan_for("a", found, backend)["backend"] == want


def test_a_cluster_of_one_measures_nothing():
    plan = RULES.ray_cluster_network_plan(
        [{"host": "a", "cluster": "solo"}], "solo", {"a": env("head", cluster="solo")}, "a", "auto", 6385
    )
    assert (plan["error"], plan["measure"]) == ("", False)
    result = RULES.ray_cluster_network_result({}, plan, SETTINGS)
    assert result["verdict"] == "pass" and "one member, no network to measure" in result["message"]


SIZE = 2 * 10**9
SETTINGS = {"bytes": SIZE, "iterations": 5, "min_busbw": 0.5, "step_allreduces": 8, "step_seconds": 600}
PLAN = plan_for("b")


def line(number, seconds=10.0, **changed):
    data = {"rank": number, "world": 3, "backend": "nccl", "bytes": SIZE, "iterations": 5, "seconds": seconds}
    return {"rc": 0, "stdout": json.dumps({**data, **changed}) + "\n", "stderr": ""}


def outputs(seconds=(10.0, 10.0, 10.0), **changed):
    """Each member's output; ranks: b 0, a 1, c 2."""
    return {h: line(r, s, **changed) for (h, r), s in zip((("b", 0), ("a", 1), ("c", 2)), seconds, strict=True)}


def test_bandwidth_is_the_slowest_ranks_the_nccl_tests_way():
    # 2 s an all-reduce on the slowest rank: algbw 1 GB/s; busbw x 2(n-1)/n = 4/3 GB/s.
    result = RULES.ray_cluster_network_result(outputs((5.0, 10.0, 7.5)), PLAN, SETTINGS)
    assert (result["seconds"], result["algbw_gbps"], result["busbw_gbps"]) == (2.0, 1.0, 1.333)
    # 8 actor-size all-reduces a step at 1 GB/s: 16 s, against the 400 s a step saves on 3 hosts (600 on one).
    assert (result["step_bytes"], result["step_comm_seconds"], result["step_seconds_saved"]) == (16 * GB, 16.0, 400.0)
    assert (result["verdict"], result["slower_than_independent"]) == ("pass", False)
    assert result["message"] == (
        "cluster c1: all-reduce of 2.00 GB (nccl, 3 members): 2.000 s, algbw 1.00 GB/s, busbw 1.33 GB/s"
    )


@pytest.mark.parametrize(
    ("seconds", "settings", "verdict", "says"),
    [
        # 1 GbE-like: 0.1 GB/s algbw, busbw 0.13: below the threshold.
        ((100.0,) * 3, {}, "fail", "busbw 0.13 GB/s, below ray_cluster_network_min_busbw 0.5 GB/s: check each"),
        # Fast enough for the threshold, but a step's gradients outlast what the cluster saves.
        ((10.0,) * 3, {"step_seconds": 20}, "warn", "A cluster job would be slower than independent runs on the same"),
        ((10.0,) * 3, {"step_allreduces": 300}, "warn", "a step's 600.0 GB of gradients take about 600 s, more than"),
        ((10.0,) * 3, {"min_busbw": 1.4}, "fail", "below ray_cluster_network_min_busbw 1.4 GB/s"),
    ],
)
def test_verdicts(seconds, settings, verdict, says):
    result = RULES.ray_cluster_network_result(outputs(seconds), PLAN, {**SETTINGS, **settings})
    assert result["verdict"] == verdict and says in result["message"], result["message"]


@pytest.mark.parametrize(
    ("member_output", "error"),
    [
        ({"rc": 1, "stdout": "", "stderr": "RuntimeError: Connection refused"}, "a: the all-reduce exited 1: Runtime"),
        ({"failed": True, "msg": "timed out after 1200 s"}, "a: the all-reduce exited none: timed out after 1200 s"),
        (None, "a: the all-reduce exited none: no output"),
        ({"rc": 0, "stdout": line(1)["stdout"] * 2, "stderr": ""}, "a: the all-reduce printed 2 lines"),
        ({"rc": 0, "stdout": "bandwidth: lots\n", "stderr": ""}, "a: the all-reduce's line is not JSON"),
        (line(1, busbw=99.0), "a: the all-reduce's line has other keys than backend, bytes"),
        ({"rc": 0, "stdout": "[1, 2]", "stderr": ""}, "has other keys"),
        (line(1, rank=True), "a: the all-reduce's rank is True, not an int"),
        (line(1, seconds="10"), "a: the all-reduce's seconds is '10', not a number"),
        (line(2), "a: the all-reduce answered rank 2 (asked 1)"),
        (line(1, bytes=4096, backend="gloo"), "answered backend 'gloo' (asked 'nccl'), bytes 4096 (asked 2000000000)"),
        (line(1, seconds=float("nan")), "a: the all-reduce's seconds is nan, not a positive time"),
        (line(1, seconds=0), "not a positive time"),
    ],
)
def test_an_output_that_is_no_measurement_names_the_member_and_what_to_check(member_output, error):
    given = outputs()
    given["a"] = member_output
    result = RULES.ray_cluster_network_result(given, PLAN, SETTINGS)
    assert result["verdict"] == "error" and "busbw_gbps" not in result
    assert error in result["message"], result["message"]
    assert "every member reaches b (10.0.0.2) on port 6385 over the fleet interface" in result["message"]


def test_the_default_size_is_the_default_models_actor_in_fp32():
    estimate = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script_estimate.py", "estimate_for_network")
    assert DEFAULTS["ray_cluster_network_bytes"] == estimate.MODELS["Qwen2.5-0.5B-Instruct"]["parameters"] * 4


def test_the_firewall_admits_the_meeting_port_from_members_only():
    ports = yaml.safe_load((REPO_ROOT / "roles" / "ray_cluster" / "vars" / "main.yml").read_text())["ray_cluster_ports"]
    assert "{{ ray_cluster_network_port }}" in ports


def test_the_roles_script_all_reduces_between_two_ranks_with_the_hosts_torch(tmp_path):
    """The script itself, two ranks over loopback with gloo (what the sandbox's CPU-only members run)."""
    python = str(cpu_venv.python())
    size = 4 * 2**20
    port = free_port()
    argv = ["127.0.0.1", str(port), str(size), "3", "gloo", "60"]
    ranks = [
        subprocess.Popen(
            [python, "-I", "-c", SCRIPT.read_text(), str(rank), "2", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={"PATH": "/usr/bin:/bin", "GLOO_SOCKET_IFNAME": "lo"},
        )
        for rank in (0, 1)
    ]
    done = [rank.communicate(timeout=120) for rank in ranks]
    found = {h: env("head" if h == "h0" else "worker", "127.0.0.1:6379", "pair", "0", "lo") for h in ("h0", "h1")}
    inventory = [{"host": "h0", "cluster": "pair"}, {"host": "h1", "cluster": "pair"}]
    plan = RULES.ray_cluster_network_plan(inventory, "pair", found, "h0", "auto", port)
    given = {
        h: {"rc": r.returncode, "stdout": out, "stderr": err}
        for h, r, (out, err) in zip(found, ranks, done, strict=True)
    }
    # Thresholds loopback on a shared test machine always meets: the verdict is known.
    settings = {**SETTINGS, "bytes": size, "iterations": 3, "min_busbw": 0.001, "step_seconds": 10**6}
    result = RULES.ray_cluster_network_result(given, plan, settings)
    assert result["verdict"] == "pass", result["message"]
    assert result["backend"] == "gloo" and result["bytes"] == size and result["busbw_gbps"] > 0
    # One rank of two: busbw = algbw x 2(2-1)/2.
    assert result["busbw_gbps"] == pytest.approx(result["algbw_gbps"], abs=0.002)


def free_port():
    """A free TCP port on loopback, for the ranks' rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
