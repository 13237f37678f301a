"""What each host now is: built from data, the runs' events and what the state directory kept.

Two sources, both saved per inventory in the state directory (hosts.json) after every run:
- the fleet_state probe's result (its contract: top-level `preflight`, `verified`,
  `reverify`, `stages`), taken from the runner_on_ok event whose `res` has a `stages` key; a
  `p40fleet report --refresh` runs playbooks/state.yml, which runs only that probe;
- gpu_preflight's published state (`gpu_preflight_state_content`, the same content the probe reads
  back as `preflight`), so a run that stops after preflight still tells the GPU, driver and profile;
and the last run each host took part in: its result, counts and first failure, verbatim.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from p40fleet.state import now

FLEET_REPORT_SCHEMA = "p40fleet.fleet-report/v1"
HOSTS_SCHEMA = "p40fleet.hosts/v1"
PROBE_KEYS = ("preflight", "verified", "reverify", "stages")
PREFLIGHT_FACT = "gpu_preflight_state_content"
# What playbooks/smoke.yml publishes per host (plugins/filter/launch_script.py shapes it).
SMOKE_FACT = "launch_script_smoke_verdict"
STATUSES = ("converged", "ok", "drift", "failed", "unreachable", "interrupted", "unknown")


def probe_results(events: Iterable[dict]) -> dict[str, dict]:
    """Each host's fleet_state probe result in a run (the last one if it ran twice)."""
    found: dict[str, dict] = {}
    for event in events:
        data = event.get("event_data", {})
        res = data.get("res")
        if event.get("event") == "runner_on_ok" and isinstance(res, dict) and "stages" in res and data.get("host"):
            found[data["host"]] = {key: res.get(key) for key in PROBE_KEYS}
    return found


def _fact_results(events: Iterable[dict], fact: str) -> dict[str, dict]:
    """Each host's last published value of the dict fact `fact` in a run."""
    found: dict[str, dict] = {}
    for event in events:
        data = event.get("event_data", {})
        facts = (data.get("res") or {}).get("ansible_facts") if isinstance(data.get("res"), dict) else None
        value = facts.get(fact) if isinstance(facts, dict) else None
        if event.get("event") == "runner_on_ok" and isinstance(value, dict) and data.get("host"):
            found[data["host"]] = value
    return found


def preflight_results(events: Iterable[dict]) -> dict[str, dict]:
    """Each host's preflight state as gpu_preflight published it in a run."""
    return _fact_results(events, PREFLIGHT_FACT)


def smoke_results(events: Iterable[dict]) -> dict[str, dict]:
    """Each host's smoke verdict in a run of playbooks/smoke.yml."""
    return _fact_results(events, SMOKE_FACT)


def update_hosts(hosts_state: dict, run: dict, events: Iterable[dict], provisioning: bool = True) -> dict:
    """hosts.json after a run: `run` is the run's entry of the report (p40fleet.report/v1). A
    provisioning run becomes each of its hosts' last run; a state refresh only updates what the
    hosts are (and says which hosts it could not read)."""
    events = list(events)
    hosts = hosts_state.setdefault("hosts", {})
    hosts_state.setdefault("schema", HOSTS_SCHEMA)
    at = run.get("finished") or now()
    for name, entry in run.get("hosts", {}).items():
        host = hosts.setdefault(name, {})
        failures = entry.get("failures") or []
        if provisioning:
            host["last_run"] = {
                "run_id": run.get("run_id", ""),
                "label": run.get("label", ""),
                "playbook": run.get("playbook", ""),
                "tags": run.get("tags"),
                "check": bool(run.get("check")),
                "started": run.get("started", ""),
                "finished": at,
                "state": entry.get("state", ""),
                "stats": entry.get("stats", {}),
                "first_failure": failures[0] if entry.get("state") in ("failed", "unreachable") and failures else None,
            }
        elif entry.get("state") in ("failed", "unreachable"):
            host["probe_error"] = {
                "at": at,
                "state": entry["state"],
                "message": failures[0]["message"] if failures else "",
            }
    for name, content in preflight_results(events).items():
        host = hosts.setdefault(name, {})
        host["preflight"] = content
        host["preflight_at"] = at
    for name, verdict in smoke_results(events).items():
        hosts.setdefault(name, {})["smoke"] = verdict
    for name, probe in probe_results(events).items():
        host = hosts.setdefault(name, {})
        host["probe"] = probe
        host["probed_at"] = at
        host["probe_run"] = run.get("run_id", "")
        host.pop("probe_error", None)
    return hosts_state


@dataclass
class Failure:
    task: str
    role: str
    message: str
    unreachable: bool = False


@dataclass
class LastRun:
    run_id: str
    label: str
    playbook: str
    started: str
    finished: str
    state: str
    stats: dict[str, int]
    check: bool = False
    tags: str | None = None


@dataclass
class HostRecord:
    host: str
    status: str
    gpu: str | None = None
    gpu_count: int | None = None
    # Per GPU, as nvidia-smi reports it with the card's ECC state (on, off, mixed; None where the card has none).
    gpu_memory_mib: int | None = None
    ecc: str | None = None
    compute_cap: str | None = None
    driver: str | None = None
    # The loaded module's flavor and version as preflight read it ("proprietary 580.95.05").
    kernel_module: str | None = None
    # driver_hold: "R580 held", "not held", or None where the stage was never read; what it pins and holds.
    driver_hold: str | None = None
    driver_pinned: list[str] = field(default_factory=list)
    driver_on_hold: list[str] = field(default_factory=list)
    os: str | None = None
    profile: str | None = None
    profile_reasons: list[str] = field(default_factory=list)
    cuda: str | None = None
    cuda_home: str | None = None
    cudnn: str | None = None
    torch: str | None = None
    apex: str | None = None
    apex_key: str | None = None
    apex_built_by: str | None = None
    verl: str | None = None
    verl_head: str | None = None
    patch_set: str | None = None
    patch_state: str | None = None
    launch_script: str | None = None
    drift: dict[str, list[str]] = field(default_factory=dict)
    verified_at: str | None = None
    # The last smoke run's verdict (playbooks/smoke.yml): ok, steps, seconds per step, peaks, summary, at.
    smoke: dict | None = None
    state_source: str | None = None
    state_at: str | None = None
    probe_error: str | None = None
    last_run: LastRun | None = None
    first_failure: Failure | None = None


def _dict(value) -> dict:
    """A host's JSON marker as a mapping: whatever else a host's file holds (a list, a string) reads as empty."""
    return value if isinstance(value, dict) else {}


def _found(stages: dict, stage: str) -> dict:
    return _dict(_dict(stages.get(stage)).get("found"))


def _dist_version(files: dict, dist: str, leaf: str) -> str | None:
    """The version in an installed distribution's dist-info directory name (torch-2.6.0+cu118.dist-info)."""
    pattern = re.compile(rf"/{re.escape(dist)}-([^/]+)\.dist-info/{re.escape(leaf)}$")
    for path, identity in files.items():
        match = pattern.search(path)
        if match and identity:
            return match.group(1)
    return None


def _file(files: dict, suffix: str) -> str | None:
    return next((path for path, identity in files.items() if path.endswith(suffix) and identity), None)


def stage_summary(stages: dict) -> dict[str, dict]:
    """What each stage installed, read from the probe's findings (the files each stage owns, with their small
    JSON records and text markers): the versions and paths a person asks for."""
    found = {stage: _found(stages, stage) for stage in stages}
    files = {stage: _dict(value.get("files")) for stage, value in found.items()}
    records = {stage: _dict(value.get("json")) for stage, value in found.items()}
    texts = {stage: _dict(value.get("text")) for stage, value in found.items()}
    cuda_version = _dict(_dict(records.get("cuda_toolkit", {}).get("version")).get("cuda")).get("version")
    cuda_json = _file(files.get("cuda_toolkit", {}), "/version.json")
    patches = _dict(records.get("verl_patches", {}).get("record"))
    identity = _dict(patches.get("identity"))
    head = str(texts.get("verl", {}).get("head") or "").strip()
    apex_marker = _dict(records.get("apex", {}).get("marker"))
    return {
        "cuda_toolkit": {"version": cuda_version, "home": os.path.dirname(cuda_json) if cuda_json else None},
        "cudnn": {"version": _dict(records.get("cudnn", {}).get("record")).get("version")},
        "pytorch": {"torch": _dist_version(files.get("pytorch", {}), "torch", "METADATA")},
        "apex": {
            "version": _dist_version(files.get("apex", {}), "apex", "RECORD"),
            "key": apex_marker.get("key"),
            # The host that built the installed wheel, as the controller recorded it when the build finished.
            "built_by": apex_marker.get("built_by") or None,
        },
        "verl": {
            "version": _dist_version(files.get("verl", {}), "verl", "direct_url.json"),
            "head": head if re.fullmatch(r"[0-9a-f]{40}", head) else None,
        },
        "verl_patches": {
            "state": "patched" if patches else None,
            "patch_set": identity.get("patch_set") or identity.get("id"),
        },
        "launch_script": {"path": _file(files.get("launch_script", {}), ".sh")},
        "driver_hold": _driver_hold(stages, records.get("driver_hold", {}).get("record")),
    }


def _driver_hold(stages: dict, record) -> dict:
    """What driver_hold's record says: the branch held (or why none), the packages pinned and held."""
    record = record if isinstance(record, dict) else {}
    if record.get("branch"):
        state = f"R{record['branch']} held"
    elif record:
        state = "not held: no driver package from apt"
    else:
        state = "not held" if "driver_hold" in stages else None
    return {"state": state, "pinned": list(record.get("pinned") or []), "held": list(record.get("held") or [])}


def _gpu_text(preflight: dict) -> tuple[str | None, int | None]:
    profile = preflight.get("profile") or {}
    if preflight.get("has_gpu") is False:
        return "no GPU", 0
    gpus = preflight.get("gpus") or []
    if profile.get("gpu_name") and profile.get("gpu_count"):
        text = f"{profile['gpu_count']}x {profile['gpu_name']}"
        hidden = sorted(set(gpus) - {profile["gpu_name"]})
        return text + (f" (also {', '.join(hidden)})" if hidden else ""), int(profile["gpu_count"])
    if gpus:
        counts = Counter(gpus)
        return ", ".join(f"{n}x {name}" for name, n in counts.items()), len(gpus)
    return None, None


def host_record(name: str, saved: dict) -> HostRecord:
    """One host's record from what hosts.json keeps about it."""
    probe = saved.get("probe") or {}
    preflight = probe.get("preflight") or saved.get("preflight") or {}
    stages = probe.get("stages") or {}
    record = HostRecord(host=name, status="unknown")
    if probe:
        record.state_source, record.state_at = "fleet_state probe", saved.get("probed_at")
    elif preflight:
        record.state_source, record.state_at = "gpu_preflight", saved.get("preflight_at")
    profile = preflight.get("profile") or {}
    record.gpu, record.gpu_count = _gpu_text(preflight)
    record.compute_cap = profile.get("compute_cap")
    record.gpu_memory_mib = profile.get("memory_mib") or None
    record.ecc = profile.get("ecc") or None
    record.driver = preflight.get("driver_version") or None
    record.os = preflight.get("os")
    record.profile = profile.get("name")
    record.profile_reasons = list(profile.get("reasons") or [])
    summary = stage_summary(stages)
    record.cuda = summary["cuda_toolkit"]["version"]
    record.cuda_home = summary["cuda_toolkit"]["home"]
    record.cudnn = summary["cudnn"]["version"]
    record.torch = summary["pytorch"]["torch"]
    record.apex = summary["apex"]["version"]
    record.apex_key, record.apex_built_by = summary["apex"]["key"], summary["apex"]["built_by"]
    record.verl, record.verl_head = summary["verl"]["version"], summary["verl"]["head"]
    record.patch_set, record.patch_state = summary["verl_patches"]["patch_set"], summary["verl_patches"]["state"]
    record.launch_script = summary["launch_script"]["path"]
    record.kernel_module = preflight.get("kernel_module") or None
    hold = summary["driver_hold"]
    record.driver_hold, record.driver_pinned, record.driver_on_hold = hold["state"], hold["pinned"], hold["held"]
    record.drift = {stage: list(spec["drift"]) for stage, spec in stages.items() if spec and spec.get("drift")}
    record.verified_at = _dict(probe.get("verified")).get("at")
    smoke = saved.get("smoke")
    record.smoke = dict(smoke) if isinstance(smoke, dict) else None
    error = saved.get("probe_error")
    if error:
        record.probe_error = f"{error.get('state')} at {error.get('at')}: {error.get('message', '')}".strip()
    last = saved.get("last_run")
    if last:
        record.last_run = LastRun(
            run_id=last.get("run_id", ""),
            label=last.get("label", ""),
            playbook=last.get("playbook", ""),
            started=last.get("started", ""),
            finished=last.get("finished", ""),
            state=last.get("state", ""),
            stats=dict(last.get("stats") or {}),
            check=bool(last.get("check")),
            tags=last.get("tags"),
        )
        first = last.get("first_failure")
        if first:
            record.first_failure = Failure(
                task=first.get("task", ""),
                role=first.get("role", ""),
                message=first.get("message", ""),
                unreachable=bool(first.get("unreachable")),
            )
    record.status = _status(record, bool(probe))
    return record


def _status(record: HostRecord, probed: bool) -> str:
    last = record.last_run
    if last and last.state in ("failed", "unreachable", "interrupted"):
        return last.state
    if record.probe_error and record.probe_error.startswith("unreachable"):
        return "unreachable"
    if record.drift:
        return "drift"
    if probed:
        return "converged"
    if last:
        return "ok"
    return "unknown"


def host_records(hosts_state: dict, hosts: Iterable[str] | None = None) -> list[HostRecord]:
    """Every host's record, in name order; `hosts` adds hosts the state directory knows nothing about."""
    saved = hosts_state.get("hosts", {})
    names = sorted(set(saved) | set(hosts or ()))
    return [host_record(name, saved.get(name, {})) for name in names]


def totals(records: Iterable[HostRecord]) -> dict[str, int]:
    records = list(records)
    counts = Counter(r.status for r in records)
    return {"hosts": len(records), **{status: counts.get(status, 0) for status in STATUSES}}


def fleet_report(records: list[HostRecord], inventory: str, generated: str | None = None) -> dict:
    return {
        "schema": FLEET_REPORT_SCHEMA,
        "generated": generated or now(),
        "inventory": inventory,
        "totals": totals(records),
        "hosts": [asdict(r) for r in records],
    }
