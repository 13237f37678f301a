"""apex's reading of the owner's probe, for root: each field checked for type and range before it becomes part of
the build key (a directory name on the controller and every host) or MAX_JOBS.

The probe (owner_scripts/apex_probe.py) runs in the env's Python as the env owner, whose output is data
(docs/privileges.md): `stdout | apex_probe_reading(rc, host)` keeps only fields of the expected shape and refuses
any other, naming the host, the field and what was found. `reading | apex_build_key(...)` and
`reading | apex_build_jobs(max_jobs, ram_per_job_gib)` derive the key and MAX_JOBS from it.
`record_text | apex_cache_verdict(wheel_name, wheel_sha256, key, record_path, build_account)` judges the key's wheel
in the controller cache against its build record: {"problem": "" or what is wrong, "record": the checked record}.
The throwaway build account is judged by fleet_state's fleet_state_throwaway_found (roles/fleet_state/tasks/
throwaway_account.yml).
`ls_stdout | apex_built_wheel_name(host, directory)` takes the one wheel name the build account listed.
Unit-tested in python/tests/test_apex_rules.py.
"""

import json
import re

from ansible.errors import AnsibleFilterError

# What each string field may hold: a version as Python, torch, nvcc and pip print them.
PATTERNS = {
    "python": re.compile(r"3\.\d{1,2}"),
    "torch": re.compile(r"(\d{1,3}\.\d{1,3}(\.\d{1,3})?([a-z0-9.]{0,16})(\+[a-z0-9.]{1,16})?)?"),
    "nvcc": re.compile(r"(\d{1,2}\.\d{1,2})?"),
    "apex": re.compile(r"[A-Za-z0-9.+_-]{0,64}"),
}
KEY = re.compile(r"[A-Za-z0-9._+-]{0,255}")
# Counts a host of this kind can have: a forged count beyond them is refused, not capped silently.
RANGES = {"cpus": (1, 4096), "mem_gib": (0, 65536)}
# A probe that failed: nothing known, the key's parts are "?" as they always were.
UNKNOWN = {"known": False, "python": "", "torch": "", "nvcc": "", "apex": "", "marker_key": "", "cpus": 1, "mem_gib": 0}


def refuse(host, what, found, fix):
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise AnsibleFilterError(f"{host}: the env's Apex probe reported {what} {shown}; {fix}")


def apex_probe_reading(stdout, rc, host="this host"):
    """The probe's report, each field checked; a probe that failed (no torch yet, no env) reads as unknown."""
    if rc != 0:
        return dict(UNKNOWN)
    fix = (
        "expected what owner_scripts/apex_probe.py prints. Re-run the conda_env and pytorch stages; if it persists, "
        "the env owner's Python or its packages were changed by hand: remove the env and re-run"
    )
    try:
        report = json.loads(stdout)
    except (TypeError, ValueError):
        refuse(host, "no JSON report:", stdout, fix)
    if not isinstance(report, dict):
        refuse(host, "a report that is no object:", report, fix)
    reading = {"known": True}
    for field, pattern in PATTERNS.items():
        value = report.get(field)
        if not isinstance(value, str) or not pattern.fullmatch(value):
            refuse(host, f"{field}", value, fix)
        reading[field] = value
    if not reading["python"]:
        refuse(host, "python", reading["python"], fix)
    marker = report.get("marker")
    if not isinstance(marker, dict):
        refuse(host, "marker", marker, fix)
    key = marker.get("key", "")
    if not isinstance(key, str) or not KEY.fullmatch(key):
        refuse(host, "the installed build key", key, fix)
    reading["marker_key"] = key
    for field, (low, high) in RANGES.items():
        value = report.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            refuse(host, f"{field}", value, f"expected a whole number from {low} to {high}. {fix}")
        reading[field] = value
    return reading


def apex_build_key(reading, arch_list, cpp_ext, cuda_ext, commit):
    """The key a wheel is tied to: hosts with equal keys share one build. Only [A-Za-z0-9._+-] (a path component)."""
    python, torch, nvcc = (reading[f] if reading["known"] else "?" for f in ("python", "torch", "nvcc"))
    text = (
        f"py{python}-torch{torch}-cuda{nvcc}-arch{arch_list}"
        f"-cpp{int(bool(cpp_ext))}cuda{int(bool(cuda_ext))}-apex{str(commit)[:12]}"
    )
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def apex_build_jobs(reading, max_jobs, ram_per_job_gib):
    """MAX_JOBS: the inventory's when set, else as many as the cores and the RAM budget allow (at least one)."""
    if int(max_jobs) > 0:
        return int(max_jobs)
    return max(1, min(reading["cpus"], reading["mem_gib"] // max(1, int(ram_per_job_gib))))


SHA256 = re.compile(r"[0-9a-f]{64}")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def apex_cache_verdict(record_text, wheel_name, wheel_sha256, key, record_path, build_account):
    """Only the wheel whose sha256 root recorded from the build account's build, for this key and file, is installed."""
    try:
        record = json.loads(record_text) if record_text else {}
    except ValueError:
        record = None
    if not isinstance(record, dict):
        return {"problem": f"has a build record that is no JSON object ({record_path})", "record": {}}
    if not record:
        return {"problem": f"has no build record ({record_path})", "record": {}}

    def shown(field):
        value = record.get(field, "?")
        return CONTROL.sub("", value if isinstance(value, str) else json.dumps(value))[:100]

    # An entry from before the build account (the env owner built it) or from anything else is no build of ours.
    if record.get("build_account") != build_account:
        problem = (
            f"was not built by the throwaway build account {build_account}: its record ({record_path}) names "
            f"{shown('build_account')} (built by {shown('builder')} on {shown('date')})"
        )
        return {"problem": problem, "record": {}}
    sha256 = record.get("sha256")
    if (
        isinstance(sha256, str)
        and SHA256.fullmatch(sha256)
        and record.get("key") == key
        and record.get("wheel") == wheel_name
        and wheel_sha256 == sha256
    ):
        return {"problem": "", "record": record}
    problem = (
        f"has sha256 {wheel_sha256 or '?'}, but its build recorded {shown('wheel')} for key {shown('key')} with sha256 "
        f"{shown('sha256')} (built by {shown('builder')} on {shown('date')})"
    )
    return {"problem": problem, "record": {}}


# What pip wheel names a wheel (name-version[-build]-python-abi-platform.whl): one path component, nothing else.
WHEEL_NAME = re.compile(r"apex-[A-Za-z0-9_.+]+(-[A-Za-z0-9_.+]+){3,4}\.whl")


def apex_built_wheel_name(ls_stdout, host="this host", directory="the build directory"):
    """The name of the one wheel the build left: listed by the build account, so data, and checked before root
    names a file by it."""
    names = [line for line in str(ls_stdout).splitlines() if line]
    if len(names) == 1 and WHEEL_NAME.fullmatch(names[0]):
        return names[0]
    shown = CONTROL.sub("", ", ".join(names))[:200] or "none"
    raise AnsibleFilterError(
        f"{host}: the Apex build left {len(names)} file(s) in {directory} ({shown}); expected one wheel named "
        "apex-VERSION-PYTHON-ABI-PLATFORM.whl. See the build log and re-run: the build starts afresh."
    )


class FilterModule:
    def filters(self):
        return {
            "apex_probe_reading": apex_probe_reading,
            "apex_build_key": apex_build_key,
            "apex_build_jobs": apex_build_jobs,
            "apex_cache_verdict": apex_cache_verdict,
            "apex_built_wheel_name": apex_built_wheel_name,
        }
