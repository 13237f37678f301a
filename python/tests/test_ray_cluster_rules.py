"""ray_cluster's decisions, table-tested without hosts: the plan (members, head, refusals), the fleet interface,
the readiness verdict on Ray's own node list (parsed strictly), and which unit starts, restarts or leaves.
The node lists are the shape `ray list nodes --format json` of Ray 2.47.1 printed (one node, recorded on a sandbox
controller: node_id, node_ip, is_head_node, state, node_name, resources_total with memory as a string)."""

from __future__ import annotations

import hashlib
import json

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_filter")
P40 = {"name": "pascal", "gpu_name": "Tesla P40", "gpu_count": 1, "compute_cap": "6.1"}
P40X2 = {**P40, "gpu_count": 2}
V100 = {"name": "volta", "gpu_name": "Tesla V100-SXM2-16GB", "gpu_count": 1, "compute_cap": "7.0"}


def inventory(*pairs):
    return [{"host": host, "cluster": cluster} for host, cluster in pairs]


def member(profile=P40, gpus=1, cpus=8):
    return {"profile": profile, "num_gpus": gpus, "num_cpus": cpus}


THREE = inventory(("a", "c1"), ("b", "c1"), ("x", ""), ("c", "c1"), ("d", "c2"))


@pytest.mark.parametrize(
    ("head", "reached", "want_head", "refusal"),
    [
        ("", {"a": member(), "b": member(), "c": member()}, "a", None),
        ("b", {"a": member(), "b": member(), "c": member()}, "b", None),
        ("d", {"a": member(), "b": member(), "c": member()}, "a", "p40fleet_cluster_head is d, which is not a member"),
        ("", {"a": member(), "c": member()}, "a", "member(s) b did not reach the cluster step"),
        (
            "",
            {"a": member(), "b": member(V100), "c": member()},
            "a",
            "mixed GPU profiles (a: 1x Tesla P40 (profile pascal, compute capability 6.1); "
            "b: 1x Tesla V100-SXM2-16GB (profile volta, compute capability 7.0)",
        ),
        ("", {"a": member(), "b": member(P40X2, gpus=2), "c": member()}, "a", "mixed GPU profiles"),
        ("", {"a": member(), "b": member(gpus=0), "c": member()}, "a", "b offer(s) no GPU to Ray"),
    ],
)
def test_plan(head, reached, want_head, refusal):
    plan = RULES.ray_cluster_plan(THREE, "c1", head, reached)
    assert plan["members"] == ["a", "b", "c"]
    assert plan["head"] == want_head
    assert plan["nnodes"] == 3
    if refusal is None:
        assert plan["refusals"] == []
        assert plan["gpus_per_node"] == 1
    else:
        assert len(plan["refusals"]) == 1
        assert refusal in plan["refusals"][0]
        assert plan["refusals"][0].startswith("cluster c1: ")


def test_plan_of_a_host_in_no_cluster_is_empty():
    plan = RULES.ray_cluster_plan(THREE, "", "", {})
    empty = {"cluster": "", "head": "", "members": [], "nnodes": 0, "gpus_per_node": 0, "refusals": []}
    assert plan == {**empty, "addresses": {}}


INTERFACES = {"lo": ["127.0.0.1"], "eth0": ["10.89.0.5"], "docker0": ["172.17.0.1"], "wg0": []}


@pytest.mark.parametrize(
    ("addresses", "wanted", "name", "address", "error"),
    [
        (["10.89.0.5"], "", "eth0", "10.89.0.5", ""),
        (["127.0.0.1"], "", "", "", "no interface holds the inventory address (127.0.0.1;"),
        (["192.0.2.1"], "", "", "", "no interface holds the inventory address (192.0.2.1;"),
        ([], "", "", "", "(unresolved; interfaces: docker0 172.17.0.1, eth0 10.89.0.5, lo 127.0.0.1, wg0 -)"),
        (["192.0.2.1"], "docker0", "docker0", "172.17.0.1", ""),
        (["10.89.0.5"], "wg0", "", "", "ray_cluster_interface is wg0, which holds no IPv4 address"),
        (["10.89.0.5"], "ib0", "", "", "ray_cluster_interface is ib0, which does not exist"),
    ],
)
def test_interface(addresses, wanted, name, address, error):
    found = RULES.ray_cluster_interface(INTERFACES, addresses, wanted, "node1")
    assert (found["name"], found["address"]) == (name, address)
    if error:
        assert found["error"].startswith("node1: ")
        assert error in found["error"]
    else:
        assert found["error"] == ""


def node(name, ip, state="ALIVE", gpus=1.0, head=False):
    resources = {"CPU": 8.0, "memory": "22.308 GiB", f"node:{ip}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    return {
        "node_id": f"{name:0<56}",
        "node_ip": ip,
        "is_head_node": head,
        "state": state,
        "state_message": None,
        "node_name": name,
        "resources_total": resources,
        "labels": {},
        "start_time_ms": None,
        "end_time_ms": None,
    }


PLAN = {"cluster": "c1", "head": "a", "members": ["a", "b", "c"], "nnodes": 3, "gpus_per_node": 1, "refusals": []}
PLAN["addresses"] = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
HEALTHY = [node("a", "10.0.0.1", head=True), node("b", "10.0.0.2"), node("c", "10.0.0.3")]


@pytest.mark.parametrize(
    ("nodes", "ready", "missing", "message"),
    [
        (HEALTHY, True, [], "cluster c1: 3 nodes alive, 3 GPUs (3 x 1), head a"),
        # A raylet that was killed leaves its old node DEAD beside the new one: the alive one counts.
        ([*HEALTHY, node("b", "10.0.0.2", state="DEAD")], True, [], "3 nodes alive"),
        (HEALTHY[:2], False, ["c"], "not ready: member(s) not alive in Ray: c."),
        ([*HEALTHY[:2], node("c", "10.0.0.3", state="DEAD")], False, ["c"], "member(s) not alive in Ray: c"),
        ([*HEALTHY[:2], node("c", "10.0.0.3", gpus=0)], False, [], "GPUs short of 1 per node: c has 0"),
        ([*HEALTHY, node("z", "10.0.0.9")], True, [], "Also alive, not members: z (stop their p40fleet-ray unit"),
    ],
)
def test_readiness(nodes, ready, missing, message):
    verdict = RULES.ray_cluster_readiness(json.dumps(nodes), PLAN)
    assert verdict["ready"] is ready
    assert verdict["missing"] == missing
    assert message in verdict["message"]


# A node's name and address are what its raylet told GCS: any process that reaches GCS (a member's owner, another
# cluster's node) can register one under a member's name, or take a member's address under another name. Before,
# a member counted as ready by its name alone, and the last node of a name won.
@pytest.mark.parametrize(
    ("nodes", "why"),
    [
        ([*HEALTHY[:2], node("c", "10.0.0.9")], "c is alive at 10.0.0.9, its address is 10.0.0.3"),
        ([*HEALTHY, node("c", "10.0.0.9")], "c is alive 2 times (at 10.0.0.3, 10.0.0.9)"),
        ([*HEALTHY[:2], node("c", "10.0.0.3"), node("c", "10.0.0.3")], "c is alive 2 times (at 10.0.0.3, 10.0.0.3)"),
        ([*HEALTHY, node("z", "10.0.0.3")], "z alive at c's address 10.0.0.3"),
        (
            [*HEALTHY[:2], node("z", "10.0.0.3"), node("c", "10.0.0.9")],
            "c is alive at 10.0.0.9, its address is 10.0.0.3",
        ),
    ],
)
def test_readiness_refuses_a_node_whose_name_or_address_is_not_its_members(nodes, why):
    verdict = RULES.ray_cluster_readiness(json.dumps(nodes), PLAN)
    assert verdict["ready"] is False
    assert f"not ready: node(s) not the member's: {why}" in verdict["message"]
    assert why in verdict["mismatched"]["c"]
    status = RULES.ray_cluster_status(json.dumps(nodes), "[]", PLAN)
    assert why in status["members"][2]["mismatch"] and not status["members"][0]["mismatch"]


def test_plan_keeps_the_address_each_member_starts_ray_on():
    members = [{"host": "a", "cluster": "c1"}, {"host": "b", "cluster": "c1"}]
    reached = {h: {"address": f"10.0.0.{i}", "num_gpus": 1} for i, h in enumerate("ab", 1)}
    assert RULES.ray_cluster_plan(members, "c1", "", reached)["addresses"] == {"a": "10.0.0.1", "b": "10.0.0.2"}


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "not JSON"),
        ("Traceback (most recent call last):", "not JSON"),
        ('{"node_name": "a"}', "a list of nodes was expected, got dict"),
        ('["a"]', "a node entry is not an object"),
        (json.dumps([{**node("a", "10.0.0.1"), "state": "ALIVE\nb"}]), "lacks node_name, node_ip or a known state"),
        (json.dumps([{**node("a", "10.0.0.1"), "node_name": 7}]), "lacks node_name"),
        (json.dumps([{**node("a", "10.0.0.1"), "resources_total": {"GPU": "8"}}]), "node a: GPU is not a number"),
        (json.dumps([{**node("a", "10.0.0.1"), "resources_total": {"GPU": True}}]), "node a: GPU is not a number"),
        (json.dumps([{**node("a", "10.0.0.1"), "resources_total": []}]), "resources_total is not an object"),
    ],
)
def test_readiness_refuses_what_is_not_a_node_list(text, reason):
    verdict = RULES.ray_cluster_readiness(text, PLAN)
    assert verdict["ready"] is False
    assert verdict["missing"] == ["a", "b", "c"]
    assert verdict["message"].startswith("cluster c1: Ray's node list could not be read (")
    assert reason in verdict["message"]


@pytest.mark.parametrize(
    ("host", "changed", "active", "head_restarted", "action"),
    [
        ("a", False, True, False, "none"),
        ("b", False, True, False, "none"),
        ("b", False, True, True, "restart"),
        ("b", True, True, False, "restart"),
        ("b", True, False, False, "start"),
        ("b", False, False, False, "start"),
        ("a", True, True, True, "restart"),
        ("a", True, False, False, "start"),
        ("z", False, True, False, "leave"),
        ("z", False, False, False, "none"),
    ],
)
def test_restarts(host, changed, active, head_restarted, action):
    assert RULES.ray_cluster_restarts(PLAN, host, changed, active, head_restarted)["action"] == action


NO_P2P = {"NCCL_P2P_DISABLE": "1"}


@pytest.mark.parametrize(
    ("before", "after", "restart"),
    [
        # Only the qualification's NCCL setting changed (P2P found broken): Ray's processes must get it.
        (({}, {}), ({}, NO_P2P), True),
        (({"WANDB_MODE": "offline"}, NO_P2P), ({"WANDB_MODE": "offline"}, {}), True),
        (({}, NO_P2P), ({}, {"NCCL_P2P_DISABLE": "0"}), True),
        (({"WANDB_MODE": "offline"}, {}), ({"WANDB_MODE": "online"}, {}), True),
        # The same environment in the file: launch_script_environment already set what qualify now adds.
        ((NO_P2P, {}), (NO_P2P, NO_P2P), False),
        # launch_script_environment wins over the NCCL setting, as in the launch script's file.
        (({"NCCL_P2P_DISABLE": "0"}, {}), ({"NCCL_P2P_DISABLE": "0"}, NO_P2P), False),
        (({"A": "1", "B": "2"}, {}), ({"B": "2", "A": "1"}, {}), False),
        # The file holds strings: an integer from YAML and its string are one value.
        (({}, {"NCCL_P2P_DISABLE": 1}), ({}, NO_P2P), False),
    ],
)
def test_node_environment_restarts_the_node_when_only_the_nccl_setting_changes(before, after, restart):
    old, new = (RULES.ray_cluster_node_environment(*pair) for pair in (before, after))
    assert (old["digest"] != new["digest"]) is restart
    changed = old["digest"] != new["digest"]
    assert RULES.ray_cluster_restarts(PLAN, "a", changed, True, False)["action"] == ("restart" if restart else "none")


def test_node_environment_refuses_what_is_no_mapping():
    with pytest.raises(RULES.RayClusterError, match="launch_script_nccl_environment must be a mapping"):
        RULES.ray_cluster_node_environment({}, "NCCL_P2P_DISABLE=1")


def test_node_environment_digest_is_the_one_the_role_kept_before():
    # A string-only environment keeps the digest the role wrote before the NCCL setting counted (to_json's
    # sort_keys, then sha256): upgrading p40fleet restarts no node whose environment did not change.
    environment = {"WANDB_MODE": "offline", "HF_HOME": "/data/hf"}
    kept = hashlib.sha256(json.dumps(environment, sort_keys=True).encode()).hexdigest()
    assert RULES.ray_cluster_node_environment(environment, {})["digest"] == kept


def job(job_id, status, start):
    return {
        "type": "SUBMISSION",
        "job_id": None,
        "submission_id": job_id,
        "status": status,
        "entrypoint": "python x.py",
        "start_time": start,
        "message": "",
        "metadata": None,
    }


@pytest.mark.parametrize(
    ("nodes", "jobs", "alive", "last", "error"),
    [
        (HEALTHY, [job("j1", "SUCCEEDED", 10), job("j2", "FAILED", 20)], [True, True, True], ("j2", "FAILED"), ""),
        (HEALTHY[:2], [], [True, True, False], None, ""),
        # Ray 2.47 prints this, not [], when it has no job (seen on the controller with the lock's ray).
        (HEALTHY, "No resource in the cluster\n", [True, True, True], None, ""),
        (HEALTHY, "No resource in the cluster, sorry", [True, True, True], None, "Ray's job list could not be read"),
        (HEALTHY, "Traceback", [True, True, True], None, "Ray's job list could not be read (not JSON"),
        ([], [{"submission_id": "j1", "status": "DONE"}], [False, False, False], None, "lacks an id or a known status"),
        (
            "",
            [job("j1", "RUNNING", None)],
            [False, False, False],
            ("j1", "RUNNING"),
            "Ray's node list could not be read",
        ),
    ],
)
def test_status(nodes, jobs, alive, last, error):
    nodes_text = nodes if isinstance(nodes, str) else json.dumps(nodes)
    jobs_text = jobs if isinstance(jobs, str) else json.dumps(jobs)
    status = RULES.ray_cluster_status(nodes_text, jobs_text, PLAN)
    assert [m["alive"] for m in status["members"]] == alive
    assert [m["head"] for m in status["members"]] == [True, False, False]
    assert status["gpus"] == sum(alive) and status["gpus_wanted"] == 3
    assert (status["last_job"]["id"], status["last_job"]["status"]) == last if last else status["last_job"] is None
    assert error in status["error"] if error else status["error"] == ""


def test_status_strips_the_control_characters_of_rays_strings_after_decoding_them():
    """A node name, a job id or an entrypoint the owner's processes gave Ray: their JSON escapes (\\u001b) decode to
    characters a terminal acts on, which the status shown to the operator no longer holds; a stray stays a stray."""
    escapes = "\x1b]0;pwned\x07\x1b[2J\u202e\r"
    nodes = [*HEALTHY, node("a" + escapes, "10.0.0.9")]
    jobs = [{**job("j1" + escapes, "RUNNING", 5), "entrypoint": "python x.py" + escapes}]
    status = RULES.ray_cluster_status(json.dumps(nodes), json.dumps(jobs), PLAN)
    assert "\\u001b" in json.dumps(nodes) and "\\u001b" in json.dumps(jobs)
    assert status["strays"] == ["a]0;pwned[2J"]
    assert status["last_job"]["id"] == "j1]0;pwned[2J"
    assert status["last_job"]["entrypoint"] == "python x.py]0;pwned[2J"
    assert [m["alive"] for m in status["members"]] == [True, True, True]


def test_cluster_status_reads_the_heads_published_status():
    from p40fleet.cluster import statuses

    published = RULES.ray_cluster_status(json.dumps(HEALTHY), "[]", PLAN)
    events = [
        {
            "event": "runner_on_ok",
            "event_data": {"host": "a", "res": {"ansible_facts": {"ray_cluster_status": published}}},
        },
        {"event": "runner_on_ok", "event_data": {"host": "b", "res": {"ansible_facts": {"other": 1}}}},
        {
            "event": "runner_on_failed",
            "event_data": {"host": "d", "res": {"ansible_facts": {"ray_cluster_status": {}}}},
        },
    ]
    assert statuses(events) == {"c1": published}


def test_cluster_status_shows_a_member_whose_node_is_not_its_own():
    from rich.console import Console

    from p40fleet.cluster import print_status

    status = RULES.ray_cluster_status(json.dumps([*HEALTHY[:2], node("c", "10.0.0.9")]), "[]", PLAN)
    console = Console(record=True, width=200)
    print_status(console, {"c1": status})
    shown = console.export_text()
    assert "not its node" in shown and "c: c is alive at 10.0.0.9, its address is 10.0.0.3" in shown


LISTED = "table inet p40fleet_ray {\n\tset ports {\n\t\ttype inet_service\n\t}\n}\n"


@pytest.mark.parametrize(
    ("listed", "recorded", "ok", "message"),
    [
        ({"rc": 0, "stdout": LISTED}, LISTED, True, ""),
        ({"rc": 0, "stdout": LISTED + "\n"}, LISTED.rstrip(), True, ""),
        ({"rc": 1, "stdout": "", "stderr": "Error: No such file or directory"}, LISTED, False, "is missing"),
        ({"rc": 2, "stdout": "", "msg": "[Errno 2] nft"}, LISTED, False, "is unreadable (nft exit 2: [Errno 2] nft)"),
        ({"rc": 0, "stdout": LISTED}, "", False, "no record of the nftables table inet p40fleet_ray root loaded"),
        (
            {"rc": 0, "stdout": LISTED.replace("\t\ttype inet_service\n", "\t\ttcp dport 6379 accept\n")},
            LISTED,
            False,
            "differs from the one root loaded (line 3: 'tcp dport 6379 accept', loaded 'type inet_service')",
        ),
        ({"rc": 0, "stdout": LISTED[:-3]}, LISTED, False, "(line 5: '(the table ends)', loaded '}')"),
    ],
)
def test_firewall_live(listed, recorded, ok, message):
    verdict = RULES.ray_cluster_firewall_live(listed, recorded, "n1")
    assert verdict["ok"] is ok
    assert message in verdict["message"] and (ok or verdict["message"].startswith("n1: "))


def test_firewall_members_names_each_member_not_ok_or_not_read():
    verdicts = {"a": {"ok": True, "message": ""}, "b": {"ok": False, "message": "b: the live table is missing"}}
    assert RULES.ray_cluster_firewall_members(verdicts, ["a", "b", "c"]) == {
        "b": "b: the live table is missing",
        "c": "c: its live firewall was not read (the host failed or was left out by --limit)",
    }
    assert RULES.ray_cluster_firewall_members(verdicts, ["a"]) == {}
    status = RULES.ray_cluster_status(json.dumps(HEALTHY), "[]", PLAN, {"b": "b: the live table is missing"})
    assert [m["firewall"] for m in status["members"]] == ["", "b: the live table is missing", ""]
