"""ray_cluster's decisions: who is in the cluster and who heads it, which interface is the fleet's, whether the
cluster Ray reports is the one the inventory asks for. Table-tested without hosts
(python/tests/test_ray_cluster_rules.py); the role's YAML only wires these to the probe, the templates and systemd.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import json
import re

from ansible_collections.p40fleet.fleet.plugins.plugin_utils import verl_batches

# What must match on every member for verl's trainer.n_gpus_per_node to hold everywhere: one GPU model and count.
PROFILE_KEYS = ("name", "gpu_name", "gpu_count", "compute_cap")
NODE_STATES = ("ALIVE", "DEAD")


class RayClusterError(ValueError):
    """Ray's answer is not the data it should be."""


# What a terminal acts on rather than shows (p40fleet.progress.CONTROLS names them): removed from the strings of Ray's
# answers that reach the operator, after their JSON is decoded (a `\u001b` escape decodes to ESC).
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _shown(text):
    return CONTROLS.sub("", text)


# What `ray list ... --format=json` of Ray 2.47 prints instead of `[]` when there is nothing to list.
NOTHING_LISTED = "No resource in the cluster"


def _listed(text):
    if isinstance(text, str) and text.strip() == NOTHING_LISTED:
        return []
    try:
        return json.loads(text)
    except (TypeError, ValueError) as error:
        raise RayClusterError(f"not JSON: {error}") from None


def ray_cluster_plan(members, cluster, head="", reached=None):
    """The plan of one cluster.

    members: [{host, cluster}] for every inventory host, in inventory order (cluster '' = none);
    reached: {host: {address, profile: {name, gpu_name, gpu_count, compute_cap}, num_gpus, num_cpus}} for the hosts
    that got this far in the play. head: the inventory name chosen by variable, '' for the first member.
    Returns {cluster, head, members: [host], nnodes, gpus_per_node, addresses: {host: fleet address}, refusals}.
    """
    reached = reached or {}
    names = [m["host"] for m in members if cluster and m.get("cluster") == cluster]
    plan = {"cluster": cluster, "head": "", "members": names, "nnodes": len(names), "gpus_per_node": 0, "refusals": []}
    # Where each member's Ray node must be: the address it starts Ray on (the fleet interface's, p40fleet-ray-node).
    plan["addresses"] = {n: str(reached[n]["address"]) for n in names if n in reached and reached[n].get("address")}
    if not cluster:
        return plan
    refusals = plan["refusals"]
    if head and head not in names:
        refusals.append(
            f"cluster {cluster}: p40fleet_cluster_head is {head}, which is not a member ({', '.join(names)}); "
            f"set it to one of them, or leave it empty for the first"
        )
    plan["head"] = head if head in names else (names[0] if names else "")
    absent = [n for n in names if n not in reached]
    if absent:
        refusals.append(
            f"cluster {cluster}: member(s) {', '.join(absent)} did not reach the cluster step (failed, unreachable "
            f"or left out by --limit); a cluster starts with every member or not at all: fix them or remove "
            f"p40fleet_cluster from their inventory entry"
        )
    profiles = {}
    for name in names:
        if name in reached:
            profile = reached[name].get("profile") or {}
            profiles[name] = tuple(str(profile.get(key, "")) for key in PROFILE_KEYS)
    if len(set(profiles.values())) > 1:
        described = "; ".join(
            f"{n}: {p[2]}x {p[1]} (profile {p[0]}, compute capability {p[3]})" for n, p in profiles.items()
        )
        refusals.append(
            f"cluster {cluster}: mixed GPU profiles ({described}); verl runs one trainer.n_gpus_per_node and one "
            f"set of dtype and memory settings on every node: put hosts of one profile in one cluster"
        )
    gpus = {n: int(reached[n].get("num_gpus", 0)) for n in names if n in reached}
    none = [n for n, g in gpus.items() if g < 1]
    if none:
        refusals.append(f"cluster {cluster}: {', '.join(none)} offer(s) no GPU to Ray; every member must train")
    if len(set(gpus.values())) > 1 and not refusals:
        counts = ", ".join(f"{n}: {g}" for n, g in gpus.items())
        refusals.append(f"cluster {cluster}: ray_cluster_num_gpus differs between members ({counts}); set one value")
    plan["gpus_per_node"] = min(gpus.values()) if gpus else 0
    return plan


def ray_cluster_interface(interfaces, addresses, wanted="", host="this host"):
    """The fleet network's interface: the one named (it must hold an IPv4 address) or the one holding the host's
    inventory address. interfaces: {name: [ipv4, ...]}; addresses: what the inventory address resolves to here.
    Returns {name, address, error}: error says what was found and what to do ('' when fine)."""
    if wanted:
        held = interfaces.get(wanted) or []
        if not held:
            return {
                "name": "",
                "address": "",
                "error": f"{host}: ray_cluster_interface is {wanted}, which "
                + ("holds no IPv4 address" if wanted in interfaces else "does not exist")
                + f" (found: {_describe(interfaces)}); name the interface of the fleet network",
            }
        chosen = [a for a in held if a in addresses]
        return {"name": wanted, "address": chosen[0] if chosen else held[0], "error": ""}
    for name, held in sorted(interfaces.items()):
        for address in held:
            if address in addresses and not ipaddress.ip_address(address).is_loopback:
                return {"name": name, "address": address, "error": ""}
    return {
        "name": "",
        "address": "",
        "error": f"{host}: no interface holds the inventory address "
        f"({', '.join(addresses) or 'unresolved'}; interfaces: "
        f"{_describe(interfaces)}); set ray_cluster_interface to the fleet network's interface, or ansible_host to "
        f"the host's address on it",
    }


def _describe(interfaces):
    return ", ".join(f"{n} {'/'.join(a) or '-'}" for n, a in sorted(interfaces.items())) or "none"


def ray_cluster_nodes(text):
    """Parse `ray list nodes --format json` strictly (it is the owner's process talking: untrusted data).
    Returns [{name, ip, alive, gpus, head}]; raises on anything else."""
    data = _listed(text)
    if not isinstance(data, list):
        raise RayClusterError(f"a list of nodes was expected, got {type(data).__name__}")
    nodes = []
    for entry in data:
        if not isinstance(entry, dict):
            raise RayClusterError("a node entry is not an object")
        name, ip, state = entry.get("node_name"), entry.get("node_ip"), entry.get("state")
        resources = entry.get("resources_total", {})
        if not isinstance(name, str) or not isinstance(ip, str) or state not in NODE_STATES:
            raise RayClusterError(f"a node entry lacks node_name, node_ip or a known state: {entry!r:.200}")
        if not isinstance(resources, dict):
            raise RayClusterError(f"node {name}: resources_total is not an object")
        gpus = resources.get("GPU", 0)
        if isinstance(gpus, bool) or not isinstance(gpus, (int, float)):
            raise RayClusterError(f"node {name}: GPU is not a number: {gpus!r:.50}")
        nodes.append(
            {"name": name, "ip": ip, "alive": state == "ALIVE", "gpus": gpus, "head": entry.get("is_head_node") is True}
        )
    return nodes


def _mismatches(nodes, plan):
    """{member: why its node is not the member's}: a member alive under its name more than once, or at an address
    that is not its own, or another name alive at its address. A node's name and address are what its raylet told
    GCS (any process that reaches GCS can register one), so both must be the member's. Addresses are judged where the
    plan knows them (plan["addresses"]: every member's, when the play reached them all)."""
    addresses = plan.get("addresses") or {}
    alive = [n for n in nodes if n["alive"]]
    found = {}
    for member in plan["members"]:
        address = addresses.get(member, "")
        named = sorted(n["ip"] for n in alive if n["name"] == member)
        others = sorted({n["name"] for n in alive if address and n["ip"] == address and n["name"] != member})
        problems = []
        if len(named) > 1:
            problems.append(f"{member} is alive {len(named)} times (at {', '.join(named)})")
        elif named and address and named[0] != address:
            problems.append(f"{member} is alive at {named[0]}, its address is {address}")
        if others:
            problems.append(f"{', '.join(others)} alive at {member}'s address {address}")
        if problems:
            found[member] = _shown("; ".join(problems))
    return found


def ray_cluster_readiness(text, plan):
    """Is the cluster Ray reports the planned one? Every member alive under its inventory name, once, at its address
    (plan["addresses"]) with gpus_per_node GPUs, nnodes x gpus_per_node in all; no other name at a member's address.
    Returns {ready, message, alive, missing, short, strays, mismatched, total}."""
    cluster = plan["cluster"]
    try:
        nodes = ray_cluster_nodes(text)
    except RayClusterError as error:
        return {
            "ready": False,
            "message": f"cluster {cluster}: Ray's node list could not be read ({error})",
            "alive": [],
            "missing": list(plan["members"]),
            "short": [],
            "strays": [],
            "mismatched": {},
            "total": 0,
        }
    alive = {n["name"]: n for n in nodes if n["alive"]}
    mismatched = _mismatches(nodes, plan)
    missing = [m for m in plan["members"] if m not in alive]
    short = [
        f"{m} has {alive[m]['gpus']:g}"
        for m in plan["members"]
        if m in alive and alive[m]["gpus"] < plan["gpus_per_node"]
    ]
    strays = sorted(n for n in alive if n not in plan["members"])
    total = sum(alive[m]["gpus"] for m in plan["members"] if m in alive)
    wanted = plan["nnodes"] * plan["gpus_per_node"]
    problems = []
    if missing:
        problems.append(f"member(s) not alive in Ray: {', '.join(missing)}")
    if short:
        problems.append(f"GPUs short of {plan['gpus_per_node']} per node: {'; '.join(short)}")
    if mismatched:
        problems.append(f"node(s) not the member's: {'; '.join(mismatched.values())}")
    if total < wanted and not missing and not short:
        problems.append(f"{total:g} GPUs in all, {wanted} wanted")
    ready = not problems
    message = (
        f"cluster {cluster}: {len(plan['members'])} nodes alive, {total:g} GPUs "
        f"({plan['nnodes']} x {plan['gpus_per_node']}), head {plan['head']}"
        if ready
        else f"cluster {cluster}: not ready: {'; '.join(problems)}. See `journalctl -u p40fleet-ray` on those hosts"
    )
    if strays:
        message += (
            f". Also alive, not members: {', '.join(strays)} (stop their p40fleet-ray unit, or add them to the cluster)"
        )
    return {
        "ready": ready,
        "message": message,
        "alive": sorted(alive),
        "missing": missing,
        "short": short,
        "strays": strays,
        "mismatched": mismatched,
        "total": total,
    }


def ray_cluster_restarts(plan, host, files_changed, active, head_restarted):
    """What the unit of `host` must do: 'leave', 'start', 'restart' or 'none', and why."""
    if not plan["cluster"] or host not in plan["members"]:
        return {"action": "leave" if active else "none", "why": f"{host} is in no cluster now"}
    if host != plan["head"] and head_restarted:
        return {"action": "restart", "why": f"the head {plan['head']} restarted: every worker rejoins it"}
    if files_changed:
        return {"action": "restart" if active else "start", "why": f"{host}'s Ray settings changed"}
    if not active:
        return {"action": "start", "why": f"{host}'s Ray node was not running"}
    return {"action": "none", "why": "healthy and unchanged"}


def ray_cluster_node_environment(environment, nccl_environment):
    """The environment p40fleet-ray-node hands `ray start` from the launch script's env file, as the launch_script
    role writes it (the qualification's NCCL settings under launch_script_environment), with its sha256: a change of
    either restarts the node, since Ray's processes keep the environment they started with."""
    given_as = {"launch_script_environment": environment, "launch_script_nccl_environment": nccl_environment}
    for name, given in given_as.items():
        if not isinstance(given, dict):
            raise RayClusterError(f"{name} must be a mapping of names to values, got {type(given).__name__}")
    merged = {str(key): str(value) for key, value in {**nccl_environment, **environment}.items()}
    digest = hashlib.sha256(json.dumps(merged, sort_keys=True).encode()).hexdigest()
    return {"names": sorted(merged), "digest": digest}


JOB_STATES = ("PENDING", "RUNNING", "STOPPED", "SUCCEEDED", "FAILED")


def ray_cluster_jobs(text):
    """Parse `ray list jobs --format json` strictly: [{id, status, entrypoint, start_time}], oldest first."""
    data = _listed(text)
    if not isinstance(data, list):
        raise RayClusterError(f"a list of jobs was expected, got {type(data).__name__}")
    jobs = []
    for entry in data:
        if not isinstance(entry, dict):
            raise RayClusterError("a job entry is not an object")
        job_id = entry.get("submission_id") or entry.get("job_id")
        status, started = entry.get("status"), entry.get("start_time")
        if not isinstance(job_id, str) or status not in JOB_STATES:
            raise RayClusterError(f"a job entry lacks an id or a known status: {entry!r:.200}")
        if started is not None and (isinstance(started, bool) or not isinstance(started, int)):
            raise RayClusterError(f"job {job_id}: start_time is not a number")
        entrypoint = entry.get("entrypoint")
        jobs.append(
            {
                "id": job_id,
                "status": status,
                "entrypoint": entrypoint if isinstance(entrypoint, str) else "",
                "start_time": started or 0,
            }
        )
    return sorted(jobs, key=lambda job: job["start_time"])


def ray_cluster_status(nodes_text, jobs_text, plan, firewalls=None):
    """What `p40fleet cluster status` shows: each member alive or not with its GPUs, nodes alive that are no
    member, and the last job with its state. Either list unreadable: said in `error`, the rest still shown.
    firewalls: {member: why its live firewall is not the one root loaded} (ray_cluster_firewall_members)."""
    firewalls = firewalls or {}
    errors = []
    try:
        nodes = ray_cluster_nodes(nodes_text)
    except RayClusterError as error:
        nodes = []
        errors.append(f"Ray's node list could not be read ({error})")
    try:
        jobs = ray_cluster_jobs(jobs_text)
    except RayClusterError as error:
        jobs = []
        errors.append(f"Ray's job list could not be read ({error})")
    alive = {n["name"]: n for n in nodes if n["alive"]}
    mismatched = _mismatches(nodes, plan)
    members = [
        {
            "name": name,
            "alive": name in alive,
            "gpus": alive[name]["gpus"] if name in alive else 0,
            "ip": alive[name]["ip"] if name in alive else "",
            "head": name == plan["head"],
            # Alive, but its name or address is not the member's (readiness refuses it): '' when it is.
            "mismatch": mismatched.get(name, ""),
            # Its live nftables table is missing or not the one root loaded: '' when it is.
            "firewall": firewalls.get(name, ""),
        }
        for name in plan["members"]
    ]
    # Ray's strings (the owner's processes talking) reach the operator without control characters; names are matched
    # to the members as Ray gave them, so a stray cannot pass for a member by a character that is not shown.
    for member in members:
        member["ip"] = _shown(member["ip"])
    last = jobs[-1] if jobs else None
    return {
        "cluster": plan["cluster"],
        "head": plan["head"],
        "members": members,
        "strays": sorted(_shown(n) for n in alive if n not in plan["members"]),
        "gpus": sum(m["gpus"] for m in members),
        "gpus_wanted": plan["nnodes"] * plan["gpus_per_node"],
        "last_job": {**last, "id": _shown(last["id"]), "entrypoint": _shown(last["entrypoint"])} if last else None,
        "error": _shown("; ".join(errors)),
    }


# The table p40fleet's ray_cluster role owns in the host's nftables: loaded whole (its file deletes and re-creates it in
# one transaction), removed whole when the host leaves its cluster; no other table is touched.
FIREWALL_TABLE = "p40fleet_ray"


def ray_cluster_firewall(members, ports, owner_uid):
    """The host's nftables ruleset for Ray, as the text of an `nft -f` file (tested by loading it in a network
    namespace, python/tests/test_ray_cluster_firewall.py).

    members: the IPv4 addresses of the cluster's members, none for a host in no cluster (its launch script's own
    Ray, on 127.0.0.1); ports: the TCP ports and ranges Ray listens on ([port] or [low, high]); owner_uid: the env
    owner, who runs Ray. A new connection to one of those ports is admitted only from a member or from this host
    itself, and from this host only when it is opened by the owner or root: another local account can neither submit
    a job (dashboard or its agent on 127.0.0.1, GCS, client server) nor reach a raylet, here or on another member.
    Only new connections are judged (`ct state new`): Ray's port 52365 lies in Linux's ephemeral range, where
    replies to this host's own outgoing connections arrive. The rules are the inet family's: IPv6 too.
    Raises ValueError on anything that is not an address, a port or a uid."""
    try:
        addresses = sorted({str(ipaddress.IPv4Address(str(a))) for a in members}, key=ipaddress.IPv4Address)
    except ValueError as error:
        raise ValueError(f"a member's address is not an IPv4 address: {error}") from None
    spans = []
    for entry in ports:
        low, high = (entry[0], entry[-1]) if isinstance(entry, (list, tuple)) else (entry, entry)
        low, high = int(low), int(high)
        if not 0 < low <= high <= 65535:
            raise ValueError(f"not a TCP port or range: {entry!r}")
        spans.append((low, high))
    spans.sort()
    merged = []
    for low, high in spans:
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    uid = int(owner_uid)
    if isinstance(owner_uid, bool) or uid < 1:
        raise ValueError(f"the owner's uid must be a positive number (the owner is never root): {owner_uid!r}")
    elements = ", ".join(str(low) if low == high else f"{low}-{high}" for low, high in merged)
    table = FIREWALL_TABLE
    # No members (a host in no cluster): no set of them, and no rule that names one (nft refuses an empty set's
    # elements list).
    members = (
        ["    set members {", "        type ipv4_addr;", f"        elements = {{ {', '.join(addresses)} }}", "    }"]
        if addresses
        else []
    )
    return "\n".join(
        [
            "# Managed by p40fleet (ray_cluster): Ray's ports, for the cluster's members and the env owner only.",
            f"table inet {table}",
            f"delete table inet {table}",
            f"table inet {table} {{",
            "    set ports {",
            "        type inet_service; flags interval;",
            f"        elements = {{ {elements} }}",
            "    }",
            *members,
            "    chain input {",
            "        type filter hook input priority filter; policy accept;",
            '        ct state new tcp dport @ports iif "lo" accept',
            *(["        ct state new tcp dport @ports ip saddr @members accept"] if addresses else []),
            "        ct state new tcp dport @ports reject with tcp reset",
            "    }",
            "    chain output {",
            "        type filter hook output priority filter; policy accept;",
            f"        ct state new tcp dport @ports meta skuid {{ 0, {uid} }} accept",
            '        ct state new tcp dport @ports oif "lo" reject with tcp reset',
            *(["        ct state new tcp dport @ports ip daddr @members reject with tcp reset"] if addresses else []),
            "    }",
            "}",
            "",
        ]
    )


def ray_cluster_firewall_live(listed, recorded, host="this host"):
    """Is the table the kernel holds now the one root loaded? listed: the result of `nft list table inet p40fleet_ray`
    now ({rc, stdout, stderr}); recorded: that listing as root took it right after loading firewall.nft ('' when none
    was taken). The file says what was meant, only the live table what is enforced: a table deleted, flushed or with a
    rule added since (by anyone with CAP_NET_ADMIN, another tool's reload) is not p40fleet's.
    Returns {ok, message}: message names what was found and what to do ('' when ok)."""
    rc = listed.get("rc")
    table = f"nftables table inet {FIREWALL_TABLE}"
    if rc not in (0, None) or not str(listed.get("stdout") or "").strip():
        error = str(listed.get("stderr") or listed.get("msg") or "").strip()
        found = (
            "missing" if rc == 1 or "No such file" in error else f"unreadable (nft exit {rc}: {_shown(error)[:200]})"
        )
        return {
            "ok": False,
            "message": f"{host}: the live {table} is {found}: Ray's ports are open to every account and address; "
            f"re-run playbooks/cluster.yml (a cluster's member) or `p40fleet train start` (one host alone) to load it",
        }
    now = [line.rstrip() for line in str(listed["stdout"]).strip().splitlines()]
    kept = [line.rstrip() for line in str(recorded or "").strip().splitlines()]
    if not kept:
        return {
            "ok": False,
            "message": f"{host}: no record of the {table} root loaded, to compare the live one with; re-run "
            f"playbooks/cluster.yml (a cluster's member) or `p40fleet train start` (one host alone)",
        }
    if now != kept:
        ends = "(the table ends)"
        first, found, wanted = next(
            (i, a, b) for i, (a, b) in enumerate(itertools.zip_longest(now, kept, fillvalue=ends)) if a != b
        )
        found, wanted = found.strip(), wanted.strip()
        return {
            "ok": False,
            "message": f"{host}: the live {table} differs from the one root loaded (line {first + 1}: "
            f"{_shown(found)!r}, loaded {wanted!r}): something changed the firewall of Ray's ports; find what did, "
            f"then re-run playbooks/cluster.yml (a cluster's member) or `p40fleet train start` (one host alone)",
        }
    return {"ok": True, "message": ""}


def ray_cluster_firewall_members(verdicts, members):
    """{member: why not} for each member whose live table is not the one root loaded, or was not read (the host
    failed or was left out); verdicts: {host: its ray_cluster_firewall_live verdict}. Empty: every member's holds."""
    found = {}
    for member in members:
        verdict = verdicts.get(member)
        if not isinstance(verdict, dict) or "ok" not in verdict:
            found[member] = f"{member}: its live firewall was not read (the host failed or was left out by --limit)"
        elif not verdict["ok"]:
            found[member] = str(verdict.get("message") or f"{member}: its live firewall is not the one root loaded")
    return found


# --- A cluster job's batch sizes at its world size (python/tests/test_ray_cluster_batches.py) ---


def ray_cluster_batches(plan, batches, mode="refuse"):
    """The batch sizes a cluster's job trains with: the configured ones where verl runs them at the plan's world size
    (nnodes x gpus_per_node); else a refusal naming the members, what verl would assert and the node counts that
    work (mode refuse), or the smallest sizes that run (mode derive), said in `note`. The rules are the launch
    settings' (plugins/plugin_utils/verl_batches.py, judge_batches).
    Returns {world, train_batch_size, ppo_mini_batch_size, val_batch_size, derived: bool, note, refusal}."""
    if mode not in verl_batches.BATCH_MODES:
        raise ValueError(f"ray_cluster_batch_sizes is {mode!r}; it is one of {', '.join(verl_batches.BATCH_MODES)}")
    world = int(plan["nnodes"]) * int(plan["gpus_per_node"])
    judged = verl_batches.judge_batches(world, batches, mode)
    result = {k: judged[k] for k in verl_batches.BATCH_KEYS}
    result.update(world=world, derived=judged["derived"], note="", refusal="")
    if not judged["why"]:
        return result
    cluster, members = plan["cluster"], ", ".join(plan["members"])
    shape = f"{plan['nnodes']} node(s) x {plan['gpus_per_node']} GPU(s) = {world} ranks"
    if judged["derived"]:
        result["note"] = (
            f"cluster {cluster} ({members}): {shape}: {judged['why']}; derived (ray_cluster_batch_sizes: derive): "
            f"{', '.join(judged['changed'])}"
        )
        return result
    gpus = int(plan["gpus_per_node"])
    counts = range(1, max(int(plan["nnodes"]), 8) + 1)
    fits = [w // gpus for w in verl_batches.worlds_that_split([k * gpus for k in counts], batches)]
    sizes = ", ".join(f"{k} ({k * gpus} ranks)" for k in fits) or "none up to 8"
    result["refusal"] = (
        f"cluster {cluster} ({members}): {shape}, which verl cannot split: {judged['why']}. Node counts of "
        f"{gpus} GPU(s) that train with these batch sizes: {sizes}. Change the cluster's members, set "
        f"launch_script_train_batch_size / launch_script_ppo_mini_batch_size for it, or set ray_cluster_batch_sizes: "
        f"derive to train with the smallest sizes that split"
    )
    return result


def ray_cluster_env_collisions(environment, owned, job_keys=()):
    """launch_script_environment's names that verl's own ray.init (owned: {name: value}) or the cluster job's runtime
    env (job_keys) also sets. Returns the message, '' when none."""
    names = sorted(environment or {})
    verl = [k for k in names if k in owned]
    job = [k for k in names if k in job_keys]
    problems = []
    if verl:
        problems.append(
            "verl's own ray.init sets "
            + ", ".join(f"{k}={owned[k]}" for k in verl)
            + " in the job's runtime env (verl/trainer/main_ppo.py:42-44) and Ray refuses a job whose environment "
            "sets such a name again"
        )
    if job:
        problems.append(
            f"the cluster's job sets {', '.join(job)} for every node (p40fleet-ray-submit's runtime env), which would "
            "replace the value silently"
        )
    if not problems:
        return ""
    return (
        f"launch_script_environment sets {', '.join(verl + job)}: {'; '.join(problems)}. Remove "
        f"{'it' if len(verl + job) == 1 else 'them'} from launch_script_environment for the cluster's hosts"
    )


# --- One checkpoint directory for the whole cluster (python/tests/test_ray_cluster_checkpoints.py) ---
# verl 0.4.1 writes each rank's model and optimizer shards to its own node's trainer.default_local_dir and the step
# marker (latest_checkpointed_iteration.txt) where the driver runs: a resume finds every shard only when all members
# see one filesystem there.


def ray_cluster_checkpoint_dir_found(found, path, host="this host"):
    """Whether root may make the shared checkpoint directory its own: absent, or a directory root owns that no one
    else can write. found: ansible.builtin.stat's `stat`. Returns the refusal, '' when fine."""
    if not found.get("exists"):
        return ""
    if not found.get("isdir"):
        return f"{host}: ray_cluster_checkpoint_dir {path} exists and is not a directory; name a directory"
    if found.get("pw_name") != "root" or found.get("wgrp") or found.get("woth"):
        return (
            f"{host}: ray_cluster_checkpoint_dir {path} is owned by {found.get('pw_name')} with mode "
            f"{found.get('mode')}; root makes it, root-owned and writable by root alone (each cluster's runs go in a "
            f"directory of the owner's inside it): give it to root (chown root:root, chmod 0755) or name another"
        )
    return ""


def ray_cluster_checkpoints_shared(plan, path, nonce, seen):
    """Is `path` one filesystem on every member? The head wrote `nonce` into a root-made file there; seen: {host:
    what each other member read back (None: no such file)}. Returns {shared, message}."""
    cluster = plan["cluster"]
    others = [m for m in plan["members"] if m != plan["head"]]
    missing = [m for m in others if seen.get(m) is None]
    differ = [m for m in others if seen.get(m) is not None and str(seen[m]).strip() != str(nonce).strip()]
    if not missing and not differ:
        return {
            "shared": True,
            "message": f"cluster {cluster}: {path} is one filesystem on {', '.join(plan['members'])}",
        }
    found = []
    if missing:
        found.append(f"{', '.join(missing)} do(es) not see the file {plan['head']} wrote there")
    if differ:
        found.append(f"{', '.join(differ)} read(s) another file there (a stale one, or another filesystem)")
    return {
        "shared": False,
        "message": f"cluster {cluster}: ray_cluster_checkpoint_dir {path} is not one filesystem on every member: "
        f"{'; '.join(found)}. verl writes each rank's checkpoint shards on its own node and resumes only where every "
        f"rank finds them: mount one shared filesystem (NFS, CephFS) at {path} on every member, or unset "
        f"ray_cluster_checkpoint_dir (the cluster then trains without resuming across nodes)",
    }


class FilterModule:
    def filters(self):
        return {
            "ray_cluster_batches": ray_cluster_batches,
            "ray_cluster_checkpoint_dir_found": ray_cluster_checkpoint_dir_found,
            "ray_cluster_checkpoints_shared": ray_cluster_checkpoints_shared,
            "ray_cluster_env_collisions": ray_cluster_env_collisions,
            "ray_cluster_firewall": ray_cluster_firewall,
            "ray_cluster_firewall_live": ray_cluster_firewall_live,
            "ray_cluster_firewall_members": ray_cluster_firewall_members,
            "ray_cluster_plan": ray_cluster_plan,
            "ray_cluster_interface": ray_cluster_interface,
            "ray_cluster_node_environment": ray_cluster_node_environment,
            "ray_cluster_readiness": ray_cluster_readiness,
            "ray_cluster_restarts": ray_cluster_restarts,
            "ray_cluster_status": ray_cluster_status,
        }
