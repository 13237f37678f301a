"""`make bench`: what a converged site.yml costs on sandbox fleets, measured side by side in one run.

Prints a table and writes .runs/bench.json. Nothing here asserts a speed (machines differ): the figures
are for people, and the only failures are runs that did not work (a converged run that changes
something is reported as such, not timed as a success).

What it measures, in order, on one sandbox (`bench`) whose hosts are plain sandbox P40 hosts:
1. Upstream bytes served to fresh fleets of 1, 2 and 4 hosts in each artifact mode (artifact_fetch_source
   upstream, mirror, controller): site.yml limited by --tags to the stages that fetch artifacts (after the
   host_prereqs stage), one fresh set of hosts per mode and size, a fresh controller cache per run; the
   bytes are read from the sandbox mirror's access log (the mirror container plays upstream, and the fleet
   mirror under another spelling of the same paths, so the log tells the two apart).
2. One first converge of the 8-host fleet, then Apex builds in it (the stand-in torch logs each build).
3. The converged re-run of site.yml next to a facts+ping play, for 1, 2, 4 and 8 hosts of that one
   converged fleet (--limit): medians of --rounds runs, with min and max, interleaved; task counts per
   host from the recap, executed tasks per stage and host from the job events.
4. `p40fleet run` (ansible-runner, progress, report) against plain `ansible-playbook`, 4 hosts, back to back
   per round; the overhead (the goal: at most 0.1 s) is also the last line printed. Mostly this row:
   `make bench BENCH_ARGS="--hosts 4 --rounds 1 --fresh-sizes '' --no-settings --extra-rounds 7"`.
5. Settings, 4 hosts: pipelining off, a jsonfile fact cache instead of memory, mitogen (--mitogen).
6. Where the 4-host converged run spends its time, per stage and task, from the job events.
Every run also records the controller's CPU time, which another job on the machine disturbs less than
wall time.
The sandbox is removed at the end, also when a step fails (--keep leaves it).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import platform
import posixpath
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import ansible.release

import p40fleet
from p40fleet.paths import SITE_PLAYBOOK
from p40fleet.run import MITOGEN_SWITCH, RunError, ansible_env, mitogen_envvars, run_playbook
from p40fleet_dev import fixtures
from p40fleet_dev.paths import REPO_ROOT, RUNS_DIR
from p40fleet_dev.sandbox import Sandbox, podman

SCHEMA = "p40fleet.bench/v1"
FACTS_PING = REPO_ROOT / "python" / "tests" / "playbooks" / "facts_ping.yml"
SCALING_SIZES = (1, 2, 4, 8)
MODES = ("upstream", "mirror", "controller")
# The stages that fetch artifacts through artifact_fetch, after the preflight whose profile they read. The
# system packages they run come first, from the host_prereqs stage alone (its own playbook: `site.yml --tags
# host_prereqs` on a fresh host also runs later stages' always-tagged probes, which need the env).
ARTIFACT_TAGS = "gpu_preflight,cuda_toolkit,cudnn,conda_env"
HOST_PREREQS_PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "host_prereqs.yml"
# The fleet mirror, in the sandbox: the mirror container itself under another spelling of each path (the
# server normalises "/fleet-mirror/../x" to "/x"), so its access log tells mirror requests from upstream ones.
FLEET_MIRROR_PREFIX = "/fleet-mirror/.."
MIRROR_BASE_URL = "{{ p40fleet_sandbox_mirror_url }}" + FLEET_MIRROR_PREFIX + "/{{ artifact_fetch_name }}/"
# Written by the stand-in torch's BuildExtension on the host that builds Apex, one line per build.
EXTENSION_BUILDS_LOG = "/var/tmp/p40fleet-standin-extension-builds.log"
LOG_LINE = re.compile(r'"(?P<method>GET|HEAD) (?P<path>\S+) HTTP/[0-9.]+" (?P<status>\d{3})')
RECAP_LINE = re.compile(r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)", re.MULTILINE)


class BenchError(RuntimeError):
    pass


@contextlib.contextmanager
def cpu_clock(include_self: bool = False):
    """Yields a list that receives the CPU seconds of the child processes that finished meanwhile (and of
    this process, if asked: ansible-runner handles the events in it)."""
    spent: list[float] = []

    def total() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds = usage.ru_utime + usage.ru_stime
        if include_self:
            own = resource.getrusage(resource.RUSAGE_SELF)
            seconds += own.ru_utime + own.ru_stime
        return seconds

    start = total()
    yield spent
    spent.append(total() - start)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- running playbooks ------------------------------------------------------------------------------
@dataclass
class Run:
    seconds: float
    rc: int
    stats: dict[str, dict[str, int]]
    events: list[dict] = field(default_factory=list, repr=False)
    stdout: str = field(default="", repr=False)
    failures: list[str] = field(default_factory=list)
    # The controller's CPU time (user + system) for the run: ansible's processes and the ssh clients that
    # ended with it (not ControlPersist's masters, which outlive it), not the hosts'. Less sensitive than wall
    # time to what else the machine runs.
    cpu_seconds: float = 0.0

    @property
    def changed(self) -> int:
        return sum(s.get("changed", 0) for s in self.stats.values())


def cmdline_for(limit: str | None = None, tags: str | None = None) -> list[str]:
    cmdline = []
    if limit:
        cmdline += ["--limit", limit]
    if tags:
        cmdline += ["--tags", tags]
    return cmdline


def via_runner(
    playbook: Path,
    inventory: Path,
    limit: str | None = None,
    tags: str | None = None,
    extravars: dict | None = None,
    envvars: dict | None = None,
) -> Run:
    """p40fleet's own path (p40fleet.run.run_playbook, ansible-runner): the job events come with it."""
    start = time.monotonic()
    with cpu_clock(include_self=True) as cpu:
        result = run_playbook(
            playbook,
            inventory,
            cmdline=cmdline_for(limit, tags),
            extravars=extravars,
            envvars=envvars,
            keep_runs=2,
        )
    seconds = time.monotonic() - start
    failures = [
        f"{f.host}: [{f.role}] {f.task}: {f.message.splitlines()[0] if f.message else ''}" for f in result.failures
    ]
    return Run(seconds, result.rc, result.stats, result.events, result.stdout, failures, cpu[0])


def _subprocess_env(inventory: Path, envvars: dict | None = None) -> dict[str, str]:
    # What run_playbook gives ansible-runner, so every path runs the same configuration; the sandbox's hosts keep
    # their facts in the sandbox's own cache (its host names are every sandbox's), removed with it.
    env = ansible_env(inventory.resolve(), envvars)
    env.setdefault("ANSIBLE_CACHE_PLUGIN_CONNECTION", str(inventory.resolve().parent / "fact_cache"))
    return env


def _recap_stats(stdout: str) -> dict[str, dict[str, int]]:
    return {m["host"]: {"ok": int(m["ok"]), "changed": int(m["changed"])} for m in RECAP_LINE.finditer(stdout)}


def via_ansible_playbook(
    playbook: Path, inventory: Path, limit: str | None = None, envvars: dict | None = None, binary: str | None = None
) -> Run:
    """Plain ansible-playbook, as a user runs it."""
    argv = [binary or str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory)]
    argv += [*cmdline_for(limit), str(playbook)]
    start = time.monotonic()
    with cpu_clock() as cpu:
        done = subprocess.run(
            argv, env=_subprocess_env(inventory, envvars), capture_output=True, text=True, check=False
        )
    seconds = time.monotonic() - start
    stats = _recap_stats(done.stdout)
    return Run(seconds, done.returncode, stats, stdout=done.stdout + done.stderr, cpu_seconds=cpu[0])


def via_cli(inventory: Path, limit: str | None = None) -> Run:
    """`p40fleet run` as a user runs it: its own process, ansible-runner, progress lines and the report."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        argv = [str(Path(sys.executable).parent / "p40fleet"), "run", "-i", str(inventory), "--report", str(report)]
        if limit:
            argv += ["-l", limit]
        start = time.monotonic()
        with cpu_clock() as cpu:
            done = subprocess.run(argv, env=_subprocess_env(inventory), capture_output=True, text=True, check=False)
        seconds = time.monotonic() - start
        stats, failures = {}, []
        if report.exists():
            hosts = json.loads(report.read_text())["runs"][-1]["hosts"]
            # The report keys hosts by name (p40fleet.report/v1); a list of entries naming theirs is read too.
            entries = list(hosts.items() if isinstance(hosts, dict) else ((h["host"], h) for h in hosts))
            stats = {name: entry["stats"] for name, entry in entries}
            failures = [
                f"{name}: [{f.get('role', '')}] {f.get('task', '')}: {(f.get('message') or '').splitlines()[:1]}"
                for name, entry in entries
                for f in entry.get("failures", [])
            ]
    return Run(seconds, done.returncode, stats, stdout=done.stdout + done.stderr, failures=failures, cpu_seconds=cpu[0])


def must_succeed(run: Run, what: str) -> Run:
    if run.rc != 0:
        detail = "\n".join(run.failures[-10:]) or run.stdout[-3000:]
        raise BenchError(f"{what} failed (rc {run.rc}):\n{detail}")
    return run


def must_be_converged(run: Run, what: str) -> Run:
    must_succeed(run, what)
    if run.changed:
        changed = {h: s["changed"] for h, s in run.stats.items() if s.get("changed")}
        raise BenchError(f"{what} is not a converged run: it changed {changed}; timing it would mislead")
    return run


# -- figures ----------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
        "runs": [round(v, 3) for v in values],
    }


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def executed_per_stage(events: list[dict]) -> dict[str, dict[str, int]]:
    """Stage (role; the play's name for tasks outside roles) -> host -> tasks that ran and were not skipped
    (runner_on_ok: ok or changed; a loop counts once)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    for event in events:
        if event.get("event") != "runner_on_ok":
            continue
        data = event.get("event_data", {})
        stage = data.get("role") or f"play: {data.get('play', '')}"
        counts[stage][data.get("host", "?")] += 1
    return {stage: dict(sorted(hosts.items())) for stage, hosts in sorted(counts.items())}


def host_counts(run: Run) -> dict[str, dict[str, int]]:
    return {
        host: {"executed": s.get("ok", 0), "changed": s.get("changed", 0), "skipped": s.get("skipped", 0)}
        for host, s in sorted(run.stats.items())
    }


def limit_for(hosts: list[str]) -> str:
    return ",".join(hosts)


# -- the mirror's access log --------------------------------------------------------------------------
def mirror_log(sandbox: Sandbox) -> Counter:
    logs = podman("logs", sandbox.mirror_container, check=False)
    return Counter((logs.stdout + logs.stderr).decode(errors="replace").splitlines())


def served_since(before: Counter, after: Counter, mirror_dir: Path) -> dict:
    """What the mirror answered between two reads of its log: complete GETs per path (the fleet mirror's
    spelling folded into the file's own path), with the bytes of the files served."""
    new = after - before
    paths: dict[str, dict] = {}
    for line, count in new.items():
        match = LOG_LINE.search(line)
        if not match or match["method"] != "GET" or match["status"] != "200":
            continue
        raw = urllib.parse.unquote(urllib.parse.urlsplit(match["path"]).path)
        via_mirror = raw.startswith(FLEET_MIRROR_PREFIX + "/")
        path = posixpath.normpath(raw)
        file = mirror_dir / path.lstrip("/")
        size = file.stat().st_size if file.is_file() else 0
        entry = paths.setdefault(path, {"requests": 0, "bytes": 0, "fleet_mirror_requests": 0, "upstream_requests": 0})
        entry["requests"] += count
        entry["bytes"] += count * size
        entry["fleet_mirror_requests" if via_mirror else "upstream_requests"] += count
        entry["size"] = size
    return dict(sorted(paths.items()))


def fresh_fleet_runs(sandbox: Sandbox, pool: list[str], sizes: list[int], mirror_dir: Path) -> dict:
    results: dict = {}
    free = list(pool)
    log(f"host_prereqs on the {len(pool)} fresh host(s), in one run (not counted: the apt repository is not logged)")
    must_succeed(via_runner(HOST_PREREQS_PLAYBOOK, sandbox.inventory_dir, limit_for(pool)), "host_prereqs")
    for mode in MODES:
        results[mode] = {}
        for size in sizes:
            hosts, free = free[:size], free[size:]
            extravars: dict = {
                "artifact_fetch_source": mode,
                # A fresh controller too: with a warm cache the controller mode would download nothing at all.
                "artifact_fetch_controller_cache_dir": str(sandbox.dir / f"bench-cache-{mode}-{size}"),
            }
            if mode == "mirror":
                extravars["p40fleet_mirror_base_url"] = MIRROR_BASE_URL
            log(f"fresh fleet of {size} ({', '.join(hosts)}), artifact_fetch_source={mode}, --tags {ARTIFACT_TAGS}")
            before = mirror_log(sandbox)
            run = via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, limit_for(hosts), ARTIFACT_TAGS, extravars)
            served = served_since(before, mirror_log(sandbox), mirror_dir)
            upstream_bytes = sum(e["size"] * e["upstream_requests"] for e in served.values())
            mirror_bytes = sum(e["size"] * e["fleet_mirror_requests"] for e in served.values())
            results[mode][str(size)] = {
                "hosts": hosts,
                "rc": run.rc,
                "failures": run.failures,
                "seconds": round(run.seconds, 1),
                "upstream_bytes": upstream_bytes,
                "fleet_mirror_bytes": mirror_bytes,
                "upstream_copies_max": max((e["upstream_requests"] for e in served.values()), default=0),
                "served": served,
            }
            if run.rc != 0:
                log(f"  the run failed (rc {run.rc}): {run.failures[-1] if run.failures else run.stdout[-500:]}")
    return results


# -- the converged fleet ---------------------------------------------------------------------------
def apex_builds(sandbox: Sandbox, hosts: list[str]) -> dict:
    by_host = {}
    for host in hosts:
        found = sandbox.exec(host, f"cat {EXTENSION_BUILDS_LOG} 2>/dev/null")
        by_host[host] = len(found.stdout.splitlines()) if found.returncode == 0 else 0
    # Identical hosts: one GPU profile, one Python/torch/CUDA stack, so one Apex build key.
    profiles = sorted({h.profile for h in sandbox.hosts() if h.name in hosts})
    return {"hosts": len(hosts), "gpu_profiles": profiles, "builds": sum(by_host.values()), "by_host": by_host}


def scaling_runs(sandbox: Sandbox, fleet: list[str], sizes: list[int], rounds: int) -> tuple[dict, dict]:
    """Per size: converged site.yml and facts+ping, `rounds` times each, interleaved."""
    inventory = sandbox.inventory_dir
    # Facts for real on every baseline run: with ansible.cfg's smart gathering and the jsonfile cache a
    # second facts+ping play would find cached facts and only ping.
    gather = {"ANSIBLE_GATHERING": "implicit"}
    runs: dict[int, dict[str, list[Run]]] = {n: {"converged": [], "baseline": []} for n in sizes}
    for round_no in range(1, rounds + 1):
        for n in sizes:
            limit = limit_for(fleet[:n])
            log(f"round {round_no}/{rounds}: {n} host(s): converged site.yml, facts+ping")
            converged = must_be_converged(via_runner(SITE_PLAYBOOK, inventory, limit), f"converged site.yml on {n}")
            baseline = must_succeed(via_runner(FACTS_PING, inventory, limit, envvars=gather), f"facts+ping on {n}")
            runs[n]["converged"].append(converged)
            runs[n]["baseline"].append(baseline)
    figures = {}
    for n in sizes:
        c = spread([r.seconds for r in runs[n]["converged"]])
        b = spread([r.seconds for r in runs[n]["baseline"]])
        figures[str(n)] = {
            "converged": c,
            "baseline": b,
            "ratio": ratio(c["median"], b["median"]),
            "cpu_seconds": {
                "converged": spread([r.cpu_seconds for r in runs[n]["converged"]]),
                "baseline": spread([r.cpu_seconds for r in runs[n]["baseline"]]),
            },
        }
    return figures, {n: runs[n]["converged"][-1] for n in sizes}


# What `p40fleet run` may cost over plain ansible-playbook on a converged fleet (issue 57), and what a converged
# run may take at most against facts+ping at every size. Printed beside the figures, never asserted (machines differ).
OVERHEAD_GOAL_SECONDS = 0.1
CONVERGED_RATIO_GOAL = 1.0


def overhead_runs(sandbox: Sandbox, fleet: list[str], rounds: int, alt_ansible: str | None) -> dict:
    limit = limit_for(fleet)
    runs: dict[str, list[Run]] = {"plain": [], "cli": [], "alt": []}
    for round_no in range(1, rounds + 1):
        log(f"round {round_no}/{rounds}: {len(fleet)} hosts: plain ansible-playbook, p40fleet run")
        plain = via_ansible_playbook(SITE_PLAYBOOK, sandbox.inventory_dir, limit)
        runs["plain"].append(must_be_converged(plain, "plain ansible-playbook"))
        runs["cli"].append(must_be_converged(via_cli(sandbox.inventory_dir, limit), "p40fleet run"))
        if alt_ansible:
            other = via_ansible_playbook(SITE_PLAYBOOK, sandbox.inventory_dir, limit, binary=alt_ansible)
            runs["alt"].append(must_be_converged(other, alt_ansible))
    wall = {k: [r.seconds for r in v] for k, v in runs.items()}
    cpu = {k: [r.cpu_seconds for r in v] for k, v in runs.items()}
    median = {k: statistics.median(v) if v else 0.0 for k, v in wall.items()}
    cpu_median = {k: statistics.median(v) if v else 0.0 for k, v in cpu.items()}
    # Per round, the difference of two back-to-back runs: less disturbed by a slow stretch of the machine than
    # the difference of two medians, which are also given.
    paired = [c - p for c, p in zip(wall["cli"], wall["plain"], strict=True)]
    paired_cpu = [c - p for c, p in zip(cpu["cli"], cpu["plain"], strict=True)]
    result = {
        "hosts": len(fleet),
        "ansible_playbook": spread(wall["plain"]),
        "p40fleet_run": spread(wall["cli"]),
        "overhead_seconds": round(median["cli"] - median["plain"], 3),
        "overhead_paired": spread(paired),
        "overhead_cpu_seconds": round(cpu_median["cli"] - cpu_median["plain"], 3),
        "overhead_cpu_paired": spread(paired_cpu),
        "goal_seconds": OVERHEAD_GOAL_SECONDS,
        "ratio": ratio(median["cli"], median["plain"]),
        "cpu_seconds": {"ansible_playbook": spread(cpu["plain"]), "p40fleet_run": spread(cpu["cli"])},
    }
    if alt_ansible:
        version = subprocess.run([alt_ansible, "--version"], capture_output=True, text=True, check=False)
        result["other_ansible"] = {
            "binary": alt_ansible,
            "version": version.stdout.splitlines()[0] if version.stdout else "?",
            "ansible_playbook": spread(wall["alt"]),
            "cpu_seconds": spread(cpu["alt"]),
            "ratio_to_this_core": ratio(median["alt"], median["plain"]),
            "cpu_ratio_to_this_core": ratio(cpu_median["alt"], cpu_median["plain"]),
        }
    return result


def mitogen_env() -> dict[str, str] | None:
    """What P40FLEET_MITOGEN=1 makes p40fleet run use, or None without mitogen."""
    try:
        return mitogen_envvars({MITOGEN_SWITCH: "1"})
    except RunError:
        return None


def settings_runs(sandbox: Sandbox, fleet: list[str], rounds: int, reference: dict, mitogen: bool) -> dict:
    """The converged run under other settings; `reference` is the default settings' row at this size."""
    limit = limit_for(fleet)
    variants = {
        "pipelining_off": {"ANSIBLE_PIPELINING": "False"},
        # ansible-runner's own default, which p40fleet's runs no longer take (python/p40fleet/run.py).
        "fact_cache_jsonfile": {
            "ANSIBLE_CACHE_PLUGIN": "jsonfile",
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(sandbox.dir / "bench-fact-cache"),
        },
    }
    if mitogen:
        variants["mitogen_linear"] = mitogen_env()
    results = {}
    for name, env in variants.items():
        runs: list[Run] = []
        outcome = "converged (changed=0)"
        for round_no in range(1, rounds + 1):
            log(f"round {round_no}/{rounds}: {len(fleet)} hosts: converged site.yml with {name} ({env})")
            run = via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, limit, envvars=env)
            if run.rc != 0 or run.changed:
                outcome = f"not usable: rc {run.rc}, changed {run.changed}: " + "; ".join(run.failures[-2:])
                log(f"  {outcome}")
                break
            runs.append(run)
        entry: dict = {"env": env, "outcome": outcome}
        if runs:
            entry["converged"] = spread([r.seconds for r in runs])
            entry["cpu_seconds"] = spread([r.cpu_seconds for r in runs])
            entry["ratio_to_default"] = ratio(entry["converged"]["median"], reference["converged"]["median"])
            entry["cpu_ratio_to_default"] = ratio(
                entry["cpu_seconds"]["median"], reference["cpu_seconds"]["converged"]["median"]
            )
        results[name] = entry
    return results


# Tasks the controller runs alone (no connection to the host): their time is templating and bookkeeping.
CONTROLLER_ACTIONS = {
    f"ansible.builtin.{name}"
    for name in (
        "set_fact",
        "assert",
        "debug",
        "fail",
        "include_vars",
        "validate_argument_spec",
        "include_tasks",
        "include_role",
        "import_tasks",
        "meta",
    )
}


def time_breakdown(run: Run, top: int = 12) -> dict:
    """Where a converged run's time goes, from the job events' own start and end times (profile_tasks is no
    part of ansible-core): per task the slowest host's duration; per stage their sum; and the tasks the
    controller runs alone (templating and bookkeeping, no connection)."""
    per_task: dict[str, dict] = {}
    for event in run.events:
        if event.get("event") not in ("runner_on_ok", "runner_on_skipped", "runner_on_failed"):
            continue
        data = event.get("event_data", {})
        entry = per_task.setdefault(
            data.get("task_uuid") or data.get("task", "?"),
            {
                "task": f"[{data.get('role') or 'play'}] {data.get('task', '?')}",
                "stage": data.get("role") or "play",
                "controller_only": (data.get("resolved_action") or data.get("task_action")) in CONTROLLER_ACTIONS,
                "seconds": 0.0,
            },
        )
        entry["seconds"] = max(entry["seconds"], float(data.get("duration") or 0.0))
    stages: Counter = Counter()
    for entry in per_task.values():
        stages[entry["stage"]] += entry["seconds"]
    controller = [e for e in per_task.values() if e["controller_only"]]
    slowest = sorted(per_task.values(), key=lambda e: -e["seconds"])[:top]
    return {
        "wall_seconds": round(run.seconds, 3),
        "cpu_seconds": round(run.cpu_seconds, 3),
        "tasks": len(per_task),
        "task_seconds": round(sum(e["seconds"] for e in per_task.values()), 3),
        "controller_only_tasks": len(controller),
        "controller_only_seconds": round(sum(e["seconds"] for e in controller), 3),
        "per_stage_seconds": {k: round(v, 3) for k, v in stages.most_common()},
        "slowest_tasks": [[e["task"], round(e["seconds"], 3)] for e in slowest],
    }


def mitogen_converge(sandbox: Sandbox, host: str) -> dict:
    """A real converge under mitogen on a fresh host, then its re-run, then a re-run without mitogen."""
    env = mitogen_env()
    first = via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, host, envvars=env)
    result = {"host": host, "first": {"rc": first.rc, "changed": first.changed, "seconds": round(first.seconds, 1)}}
    result["first"]["failures"] = first.failures
    if first.rc == 0:
        again = via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, host, envvars=env)
        plain = via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, host)
        result["rerun_mitogen"] = {"rc": again.rc, "changed": again.changed}
        result["rerun_linear"] = {"rc": plain.rc, "changed": plain.changed}
    result["correct"] = (
        first.rc == 0
        and first.changed > 0
        and result.get("rerun_mitogen", {}).get("changed") == 0
        and result.get("rerun_linear", {}).get("changed") == 0
    )
    return result


# -- output ---------------------------------------------------------------------------------------
def fmt(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:7.2f} s  ({s['min']:.2f}-{s['max']:.2f})"


def print_table(data: dict) -> None:
    out = []
    add = out.append
    add("")
    add(f"p40fleet bench  ({data['machine']['cpus']} cores, ansible-core {data['machine']['ansible_core']})")
    for note in data["notes"]:
        add(f"  note: {note}")
    cob = data.get("converged_over_baseline")
    if cob:
        add("")
        add(f"Converged site.yml vs facts+ping, {cob['hosts']} hosts (median (min-max) of {data['options']['rounds']})")
        add(f"  converged site.yml        {fmt(cob['converged'])}")
        add(f"  facts+ping                {fmt(cob['baseline'])}")
        add(f"  ratio                     {cob['ratio']} x")
        for host, c in cob["tasks_per_host"].items():
            add(f"  {host:8} executed {c['executed']:3}  skipped {c['skipped']:3}  changed {c['changed']}")
        add(f"  executed tasks per stage and host, max: {data['executed_tasks_per_stage_max']}")
        for stage, hosts in data["executed_tasks_per_stage"].items():
            add(f"    {stage:28} {max(hosts.values()):3}")
    scaling = data.get("scaling")
    if scaling:
        add("")
        add("Scaling (one converged fleet, --limit)")
        add(f"  {'hosts':>5}  {'converged site.yml':26} {'facts+ping':26} ratio  conv/1  base/1")
        for n, row in scaling.items():
            add(
                f"  {n:>5}  {fmt(row['converged']):26} {fmt(row['baseline']):26} {row['ratio']:5}  "
                f"{row['converged_over_1']:6}  {row['baseline_over_1']:6}"
            )
        add(
            f"  scaling_8_over_1 {data.get('scaling_8_over_1')}  baseline_scaling_8_over_1 "
            f"{data.get('baseline_scaling_8_over_1')}"
        )
        over_goal = [n for n, row in scaling.items() if (row["ratio"] or 0) > CONVERGED_RATIO_GOAL]
        verdict = f"over it at {', '.join(over_goal)} host(s)" if over_goal else "met at every size"
        add(f"  converged over facts+ping, goal at most {CONVERGED_RATIO_GOAL} x: {verdict}")
    fetch = data.get("artifact_fetch")
    if fetch:
        add("")
        add(f"Fresh fleets, site.yml --tags {ARTIFACT_TAGS}: bytes the mirror container served")
        add(f"  {'mode':10} {'hosts':>5} {'upstream bytes':>15} {'fleet mirror bytes':>19} {'max copies':>10}  rc")
        for mode, sizes in fetch.items():
            for n, row in sizes.items():
                add(
                    f"  {mode:10} {n:>5} {row['upstream_bytes']:15,} {row['fleet_mirror_bytes']:19,} "
                    f"{row['upstream_copies_max']:10}  {row['rc']}"
                )
    apex = data.get("apex_builds")
    if apex:
        add("")
        add(
            f"Apex builds in a fleet of {apex['hosts']} identical hosts (GPU profiles {apex['gpu_profiles']}):"
            f" {apex['builds']}  {apex['by_host']}"
        )
    over = data.get("p40fleet_run_overhead")
    if over:
        add("")
        add(f"p40fleet run vs ansible-playbook, converged, {over['hosts']} hosts")
        add(f"  ansible-playbook          {fmt(over['ansible_playbook'])}")
        add(f"  p40fleet run              {fmt(over['p40fleet_run'])}")
        goal = f"goal at most {over['goal_seconds']} s"
        add(f"  overhead                  {over['overhead_seconds']} s ({over['ratio']} x), {goal}")
        add(f"  overhead, per round       {fmt(over['overhead_paired'])}")
        cpu = f"{over['overhead_cpu_seconds']} s, per round {fmt(over['overhead_cpu_paired'])}"
        add(f"  controller CPU overhead   {cpu}")
        other = over.get("other_ansible")
        if other:
            add(
                f"  {other['version'][:24]:25} {fmt(other['ansible_playbook'])}  ({other['ratio_to_this_core']} x wall,"
                f" {other['cpu_ratio_to_this_core']} x controller CPU)"
            )
    settings = data.get("settings")
    if settings:
        add("")
        add("Settings, converged site.yml (ratio to the default settings' median)")
        for name, row in settings.items():
            add(
                f"  {name:20} {fmt(row.get('converged'))}  {row.get('ratio_to_default', '-')} x wall"
                f"  {row.get('cpu_ratio_to_default', '-')} x CPU  {row['outcome']}"
            )
    mitogen = data.get("mitogen_converge")
    if mitogen:
        add(f"  mitogen real converge on a fresh host: {'correct' if mitogen['correct'] else 'NOT correct'} {mitogen}")
    breakdown = data.get("time_breakdown")
    if breakdown:
        add("")
        add(
            f"Where one converged run's time goes ({breakdown['wall_seconds']} s wall, {breakdown['cpu_seconds']} s"
            f" controller CPU): {breakdown['tasks']} tasks, {breakdown['task_seconds']} s summed (slowest host);"
            f" {breakdown['controller_only_tasks']} controller-only tasks, {breakdown['controller_only_seconds']} s"
        )
        add("  per stage: " + ", ".join(f"{k} {v}" for k, v in breakdown["per_stage_seconds"].items()))
        for name, seconds in breakdown["slowest_tasks"]:
            add(f"  {seconds:6.2f} s  {name}")
    if over:
        add("")
        add(
            f"p40fleet run overhead: {over['overhead_seconds']} s over ansible-playbook (medians,"
            f" {over['hosts']} hosts, converged; goal at most {over['goal_seconds']} s)"
        )
    add("")
    add(f"written: {data['json']}")
    print("\n".join(out))


# -- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8, help="largest converged fleet (scaling 1, 2, 4, 8 up to it)")
    parser.add_argument("--rounds", type=int, default=5, help="runs per figure (medians)")
    parser.add_argument("--extra-rounds", type=int, default=3, help="runs per settings row and overhead figure")
    parser.add_argument("--fresh-sizes", default="1,2,4", help="fresh fleet sizes per artifact mode ('' skips)")
    parser.add_argument("--mitogen", action="store_true", help="add mitogen rows (needs `pip install mitogen`)")
    parser.add_argument("--no-settings", action="store_true", help="skip the pipelining and fact cache rows")
    parser.add_argument("--other-ansible", help="another ansible-playbook binary to time beside this one")
    parser.add_argument("--quick", action="store_true", help="a small version: --hosts 2 --rounds 2 --fresh-sizes 1")
    parser.add_argument(
        "--inventory-vars",
        type=json.loads,
        default={},
        help="JSON object of variables for every bench host (an inventory file, so every run path sees them),"
        " e.g. '{\"gpu_preflight_strict\": false}' where a shared disk is short of what preflight asks",
    )
    parser.add_argument("--json", type=Path, default=RUNS_DIR / "bench.json")
    parser.add_argument("--keep", action="store_true", help="leave the sandbox running")
    args = parser.parse_args(argv)
    if args.quick:
        args.hosts, args.rounds, args.extra_rounds, args.fresh_sizes = 2, 2, 2, "1"
    sizes = [n for n in SCALING_SIZES if n <= args.hosts] or [args.hosts]
    fresh_sizes = [int(x) for x in args.fresh_sizes.split(",") if x.strip()]
    if args.mitogen and mitogen_env() is None:
        parser.error("--mitogen: ansible_mitogen is not importable here (pip install -c constraints.txt mitogen)")
    # The default rows run the default strategy, whatever the caller's shell opts in to; mitogen has its rows.
    os.environ[MITOGEN_SWITCH] = "0"
    # p40fleet's bytecode, as pip writes it when it installs the wheel (and ansible-core's, which the
    # ansible-playbook rows run from): under PYTHONDONTWRITEBYTECODE a checkout would compile p40fleet's
    # modules on every start, a cost no installed p40fleet pays (docs/benchmarks-overhead.md).
    compileall.compile_dir(Path(p40fleet.__file__).parent, quiet=1)

    fleet_size = max(sizes)
    # Fresh hosts for the artifact modes come first in the pool; the converged fleet reuses the first ones
    # (their artifact stages are done by then, the rest of site.yml is not), and mitogen gets one of its own.
    fresh_needed = sum(fresh_sizes) * len(MODES)
    total = max(fleet_size, fresh_needed) + (1 if args.mitogen else 0)
    names = [f"node{i}" for i in range(1, total + 1)]
    fleet = names[:fleet_size]
    compare_at = fleet[: min(4, fleet_size)]
    started = time.monotonic()
    data: dict = {
        "schema": SCHEMA,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "ansible_core": ansible.release.__version__,
        },
        "options": {
            "hosts": args.hosts,
            "rounds": args.rounds,
            "extra_rounds": args.extra_rounds,
            "fresh_sizes": fresh_sizes,
            "mitogen": args.mitogen,
            "inventory_vars": args.inventory_vars,
        },
        "notes": [
            f"one sandbox of {total} host(s); the 1/2/4/8-host figures are one converged {fleet_size}-host fleet"
            " run with --limit (the sandbox hosts share the controller's cores)",
            "facts+ping gathers facts on every run (ANSIBLE_GATHERING=implicit): ansible.cfg's smart gathering"
            " with the jsonfile cache would skip the gathering after the first run",
            "converged runs go through p40fleet.run (ansible-runner), so do the baselines; the overhead row"
            " compares the p40fleet run command with plain ansible-playbook",
            "fresh-fleet hosts were fresh sandbox hosts; the converged fleet reuses the first of them",
        ],
        "json": str(args.json),
    }
    sandbox = Sandbox("bench")
    try:
        log(f"sandbox bench: {total} hosts")
        sandbox.up(["p40"] * total)
        if args.inventory_vars:
            # Beside the sandbox's own group_vars, read by ansible-playbook, ansible-runner and p40fleet run alike.
            (sandbox.inventory_dir / "group_vars" / "all.yml").write_text(
                "---\n" + json.dumps(args.inventory_vars) + "\n"
            )
            data["notes"].append(f"every host had these inventory variables: {json.dumps(args.inventory_vars)}")
        mirror_dir = fixtures.build_standins().mirror_dir
        if fresh_sizes:
            data["artifact_fetch"] = fresh_fleet_runs(sandbox, names[:fresh_needed], fresh_sizes, mirror_dir)
        log(f"first converge of the {fleet_size}-host fleet")
        first = must_succeed(via_runner(SITE_PLAYBOOK, sandbox.inventory_dir, limit_for(fleet)), "first converge")
        data["first_converge"] = {"hosts": fleet_size, "seconds": round(first.seconds, 1), "changed": first.changed}
        data["apex_builds"] = apex_builds(sandbox, fleet)

        scaling, last = scaling_runs(sandbox, fleet, sizes, args.rounds)
        one = scaling[str(sizes[0])]
        for row in scaling.values():
            row["converged_over_1"] = ratio(row["converged"]["median"], one["converged"]["median"])
            row["baseline_over_1"] = ratio(row["baseline"]["median"], one["baseline"]["median"])
        data["scaling"] = scaling
        data["scaling_8_over_1"] = scaling.get("8", {}).get("converged_over_1")
        data["baseline_scaling_8_over_1"] = scaling.get("8", {}).get("baseline_over_1")
        data["converged_ratio_goal"] = CONVERGED_RATIO_GOAL
        n = str(len(compare_at))
        data["converged_over_baseline"] = {
            "hosts": len(compare_at),
            "ratio": scaling[n]["ratio"],
            "converged": scaling[n]["converged"],
            "baseline": scaling[n]["baseline"],
            "tasks_per_host": host_counts(last[len(compare_at)]),
        }
        per_stage = executed_per_stage(last[len(compare_at)].events)
        data["time_breakdown"] = time_breakdown(last[len(compare_at)])
        data["executed_tasks_per_stage"] = per_stage
        data["executed_tasks_per_stage_max"] = max((max(h.values()) for h in per_stage.values()), default=0)

        data["p40fleet_run_overhead"] = overhead_runs(sandbox, compare_at, args.extra_rounds, args.other_ansible)
        if not args.no_settings:
            data["settings"] = settings_runs(sandbox, compare_at, args.extra_rounds, scaling[n], args.mitogen)
        if args.mitogen:
            log(f"mitogen: a real converge of fresh host {names[-1]}")
            data["mitogen_converge"] = mitogen_converge(sandbox, names[-1])
        data["apex_builds_after_reruns"] = apex_builds(sandbox, fleet)["builds"]
    except BenchError as error:
        data["error"] = str(error)
        log(f"stopped: {error}")
    finally:
        data["seconds_total"] = round(time.monotonic() - started, 1)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2) + "\n")
        if args.keep:
            log(f"sandbox bench kept: {sandbox.inventory_dir}")
        else:
            try:
                sandbox.down()
            except Exception as error:  # the figures are written all the same; say what is left running
                log(f"could not remove sandbox bench ({error}): run `python -m p40fleet_dev sandbox down --name bench`")
    print_table(data)
    return 1 if "error" in data else 0


if __name__ == "__main__":
    sys.exit(main())
