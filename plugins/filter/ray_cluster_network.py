"""ray_cluster's network measurement, decided here: who takes which rank of the all-reduce between a cluster's members
and where they meet (ray_cluster_network_plan), and what the members' outputs say (ray_cluster_network_result): the
bus bandwidth, computed the nccl-tests way, and whether a cluster job would be slower than independent runs on the
same hosts. Each member's output is the env owner's process talking: parsed strictly as data, never trusted.
Table-tested without hosts (python/tests/test_ray_cluster_network_rules.py).
"""

from __future__ import annotations

import ipaddress
import json
import math
import re

IFNAME = re.compile(r"[A-Za-z0-9_.:@-]{1,15}")
BACKENDS = ("gloo", "nccl")
# The keys of the one line owner_scripts/network_allreduce.py prints, and nothing else.
OUTPUT_KEYS = {"rank": int, "world": int, "backend": str, "bytes": int, "iterations": int, "seconds": float}
KIND_NAMES = {int: "an int", float: "a number", str: "a string"}
GB = 1e9
# Root's file every member's Ray node reads (templates/ray.env.j2), named in messages.
RAY_ENV = "/etc/p40fleet/ray/ray.env"


def _hosts(names):
    return ", ".join(names)


# The ports line of the firewall's `set ports` (ray_cluster_firewall in plugins/filter/ray_cluster.py writes it).
FIREWALL_PORTS = re.compile(r"set ports \{[^}]*?elements = \{ ([0-9, -]+) \}", re.DOTALL)


def _firewall_admits(text, port):
    """Whether a firewall file p40fleet wrote names `port` among the ports only members may reach."""
    match = FIREWALL_PORTS.search(text or "")
    for span in match.group(1).split(",") if match else []:
        low, _, high = span.strip().partition("-")
        if low.isdigit() and int(low) <= port <= int(high or low):
            return True
    return False


def ray_cluster_network_plan(
    inventory, cluster, found, host, backend="auto", port=0, unformed="fail", firewalls=None, forks=None
):
    """This host's part of the cluster's all-reduce. inventory: [{host, cluster}] in inventory order; found: {host:
    the settings its root-owned ray.env holds} for every host of the play that read it. The head (as
    playbooks/cluster.yml formed the cluster) is rank 0 and the meeting point, the other members follow in inventory
    order. unformed: skip measures nothing (skipped says why) where no member holds this cluster's ray.env yet (qualify
    before the first playbooks/cluster.yml), fail refuses it. firewalls: {host: its firewall file (root's)}; the
    head's must name the port, so that the meeting point is reachable from the members only. forks: Ansible's
    (ansible_forks), which must start every member at once. {measure, rank, world, members, head, address, port,
    iface, backend, skipped, error}."""
    members = [m["host"] for m in inventory if m.get("cluster") == cluster]
    plan = {"cluster": cluster, "measure": False, "members": members, "world": len(members), "port": int(port)}
    plan.update({"rank": 0, "head": "", "address": "", "iface": "", "backend": "", "skipped": "", "error": ""})

    def refuse(problem):
        return {**plan, "error": f"{host}: cluster {cluster}: {problem}. The all-reduce measured nothing"}

    if host not in members:
        return refuse(f"{host} is no member (members: {_hosts(members) or 'none'})")
    # Ansible runs a task on at most `forks` hosts at once: the ranks past it would start only after the first ones
    # gave up waiting for them.
    if forks is not None and len(members) > int(forks):
        return refuse(
            f"its {len(members)} members are more than Ansible runs at once (forks {forks}), and the all-reduce "
            f"needs every member at once: run with --forks {len(members)} or more (ansible.cfg: forks)"
        )
    missing = [m for m in members if m not in found]
    if missing:
        return refuse(
            f"member(s) {_hosts(missing)} are not in this run (left out by --limit, unreachable or failed earlier): "
            f"the all-reduce needs every member at once; run without --limit or bring them back"
        )
    if unformed == "skip" and not any(found[m].get("P40FLEET_RAY_CLUSTER") == cluster for m in members):
        return {
            **plan,
            "skipped": f"cluster {cluster}: not formed yet (no member's {RAY_ENV} names it), so its network was not "
            f"measured: run playbooks/cluster.yml, then qualify again",
        }
    stale = [
        f"{m} ({found[m].get('P40FLEET_RAY_CLUSTER') or 'none'})"
        for m in members
        if found[m].get("P40FLEET_RAY_CLUSTER") != cluster
    ]
    if stale:
        return refuse(f"{RAY_ENV} names another cluster or none on {_hosts(stale)}: run playbooks/cluster.yml first")
    heads = [m for m in members if found[m].get("P40FLEET_RAY_ROLE") == "head"]
    addresses = sorted({found[m].get("P40FLEET_RAY_HEAD_ADDRESS", "") for m in members})
    if len(heads) != 1 or len(addresses) != 1:
        return refuse(
            f"the members' {RAY_ENV} disagree on the head (head role on {_hosts(heads) or 'none'}; head addresses "
            f"{_hosts(addresses)}): run playbooks/cluster.yml to form the cluster again"
        )
    address = addresses[0].rpartition(":")[0]
    try:
        ipaddress.IPv4Address(address)
    except ValueError:
        return refuse(
            f"the head address {addresses[0]!r} in {RAY_ENV} is no IPv4 address:port: run playbooks/cluster.yml"
        )
    if firewalls is not None and not _firewall_admits(firewalls.get(heads[0], ""), int(port)):
        return refuse(
            f"the firewall of the head {heads[0]} (/etc/p40fleet/ray/firewall.nft) does not name port {port} among "
            f"the ports only members may reach: run playbooks/cluster.yml, which adds it"
        )
    iface = found[host].get("NCCL_SOCKET_IFNAME", "")
    if not IFNAME.fullmatch(iface):
        return refuse(f"NCCL_SOCKET_IFNAME={iface!r} in {RAY_ENV} is no interface name: run playbooks/cluster.yml")
    if backend == "auto":
        gpus = [str(found[m].get("P40FLEET_RAY_NUM_GPUS", "0")) for m in members]
        backend = "nccl" if all(g.isdigit() and int(g) > 0 for g in gpus) else "gloo"
    if backend not in BACKENDS:
        return refuse(f"ray_cluster_network_backend is {backend!r}: set auto, gloo or nccl")
    ranks = [heads[0]] + [m for m in members if m != heads[0]]
    return {
        **plan,
        "measure": len(members) > 1,
        "rank": ranks.index(host),
        "head": heads[0],
        "address": address,
        "iface": iface,
        "backend": backend,
    }


def _parsed(output, host, rank, plan, size, iterations):
    """One member's output as data: exactly one JSON line with exactly OUTPUT_KEYS, agreeing with what it was asked."""
    text = output.get("stdout", "") if isinstance(output, dict) else ""
    lines = [line for line in str(text).splitlines() if line.strip()]
    if not isinstance(output, dict) or output.get("rc") != 0:
        given = output if isinstance(output, dict) else {}
        # The module's own message where the owner's command never ended (its time limit), else the owner's stderr.
        tail = str(given.get("stderr") or given.get("msg") or "").strip()[-300:]
        return None, f"{host}: the all-reduce exited {given.get('rc', 'none')}: {tail or 'no output'}"
    if len(lines) != 1:
        return None, f"{host}: the all-reduce printed {len(lines)} lines, one JSON line was expected"
    try:
        data = json.loads(lines[0])
    except ValueError:
        return None, f"{host}: the all-reduce's line is not JSON: {lines[0][:120]!r}"
    if not isinstance(data, dict) or set(data) != set(OUTPUT_KEYS):
        return None, f"{host}: the all-reduce's line has other keys than {', '.join(sorted(OUTPUT_KEYS))}"
    for key, kind in OUTPUT_KEYS.items():
        value = data[key]
        if isinstance(value, bool) or not (isinstance(value, kind) or (kind is float and isinstance(value, int))):
            return (
                None,
                f"{host}: the all-reduce's {key} is {value!r:.60}, not {KIND_NAMES[kind]}",
            )
    asked = {"rank": rank, "world": plan["world"], "backend": plan["backend"], "bytes": size, "iterations": iterations}
    wrong = [f"{key} {data[key]!r} (asked {value!r})" for key, value in asked.items() if data[key] != value]
    if wrong:
        return None, f"{host}: the all-reduce answered {', '.join(wrong)}"
    if not math.isfinite(data["seconds"]) or data["seconds"] <= 0:
        return None, f"{host}: the all-reduce's seconds is {data['seconds']!r}, not a positive time"
    return data, ""


def ray_cluster_network_result(outputs, plan, settings):
    """The measurement from every member's output (outputs: {host: {rc, stdout, stderr}}, the plan of any member).
    nccl-tests' arithmetic: the time of one all-reduce is the slowest rank's, algbw = bytes / time, busbw = algbw x
    2(n-1)/n (what each link carried). A step's gradients (settings.step_allreduces all-reduces of the actor's size)
    then take step_bytes / algbw; a cluster job is slower than independent runs on the same hosts where that is more
    than the compute a step saves on n hosts: step_seconds x (1 - 1/n). verdict: fail under settings.min_busbw (GB/s),
    warn where slower, else pass; error where a member's output is no measurement; skip where the plan skipped."""
    n = plan["world"]
    size = int(settings["bytes"]) // 4 * 4
    iterations = int(settings["iterations"])
    result = {"cluster": plan["cluster"], "members": plan["members"], "world": n, "backend": plan["backend"]}
    result.update({"bytes": size, "iterations": iterations, "verdict": "error", "message": ""})
    if plan.get("skipped"):
        return {**result, "verdict": "skip", "message": plan["skipped"]}
    if not plan.get("measure"):
        return {**result, "verdict": "pass", "message": f"cluster {plan['cluster']}: one member, no network to measure"}
    ranks = [plan["head"]] + [m for m in plan["members"] if m != plan["head"]]
    times, errors = [], []
    for rank, host in enumerate(ranks):
        data, error = _parsed((outputs or {}).get(host), host, rank, plan, size, iterations)
        if error:
            errors.append(error)
        else:
            times.append(data["seconds"] / iterations)
    if errors:
        return {
            **result,
            "message": f"cluster {plan['cluster']}: the all-reduce between the members was not measured: "
            f"{'; '.join(errors)}. Check that every member reaches {plan['head']} ({plan['address']}) on port "
            f"{plan['port']} over the fleet interface, and that the env's torch imports as the env owner",
        }
    seconds = max(times)
    algbw = size / seconds
    busbw = algbw * 2 * (n - 1) / n
    step_bytes = size * float(settings["step_allreduces"])
    step_comm = step_bytes / algbw
    saved = float(settings["step_seconds"]) * (1 - 1 / n)
    result.update(
        {
            "seconds": round(seconds, 6),
            "algbw_gbps": round(algbw / GB, 3),
            "busbw_gbps": round(busbw / GB, 3),
            "step_bytes": int(step_bytes),
            "step_comm_seconds": round(step_comm, 1),
            "step_seconds_saved": round(saved, 1),
            "slower_than_independent": step_comm >= saved,
        }
    )
    measured = (
        f"cluster {plan['cluster']}: all-reduce of {size / GB:.2f} GB ({plan['backend']}, {n} members): "
        f"{seconds:.3f} s, algbw {algbw / GB:.2f} GB/s, busbw {busbw / GB:.2f} GB/s"
    )
    if busbw / GB < float(settings["min_busbw"]):
        return {
            **result,
            "verdict": "fail",
            "message": f"{measured}, below ray_cluster_network_min_busbw {settings['min_busbw']} GB/s: check each "
            f"member's fleet link ({plan['iface']}: speed, duplex, MTU, with ethtool) and the switch between them",
        }
    if step_comm >= saved:
        return {
            **result,
            "verdict": "warn",
            "message": f"{measured}. A cluster job would be slower than independent runs on the same hosts: a "
            f"step's {step_bytes / GB:.1f} GB of gradients take about {step_comm:.0f} s, more than the {saved:.0f} s "
            f"a step saves on {n} hosts (ray_cluster_network_step_seconds {settings['step_seconds']} s on one). "
            f"Train one run per host (p40fleet train start without --cluster), or give the members a faster network",
        }
    return {**result, "verdict": "pass", "message": measured}


class FilterModule:
    def filters(self):
        return {
            "ray_cluster_network_plan": ray_cluster_network_plan,
            "ray_cluster_network_result": ray_cluster_network_result,
        }
