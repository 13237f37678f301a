"""The fault suite's table: each case, its tests' outcomes and what it still needs, printed at the end.

`make test` runs the cases that fit CI's time budget; the ones marked `faults_full` (kills, disk filling up,
the second source of every tampered artifact) run only under `make faults` (P40FLEET_FAULTS=full), and the
table says so for each case instead of leaving it out. python/tests/conftest.py calls these from its hooks.
"""

from __future__ import annotations

import os

import pytest
from tests.faults.cases import BY_NUMBER, CASES

FULL = os.environ.get("P40FLEET_FAULTS") == "full"

_case_of: dict[str, tuple[int, ...]] = {}
_deselected: set[str] = set()


def configure(config):
    config.addinivalue_line("markers", "fault_case(*numbers): the fault case(s) (faults/cases.py) this test proves")
    config.addinivalue_line("markers", "faults_full: too slow for make test's budget; runs under make faults")


def collect(config, items):
    kept = []
    for item in items:
        numbers = tuple(n for marker in item.iter_markers("fault_case") for n in marker.args)
        if numbers:
            unknown = [n for n in numbers if n not in BY_NUMBER]
            if unknown:
                raise pytest.UsageError(f"{item.nodeid}: fault_case {unknown} is not a case in faults/cases.py")
            _case_of[item.nodeid] = numbers
        if item.get_closest_marker("faults_full") and not FULL:
            _deselected.add(item.nodeid)
        else:
            kept.append(item)
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.nodeid in _deselected])
        items[:] = kept
    # Under pytest-xdist only the workers collect: each hands what the table needs to the controller, which prints it.
    if hasattr(config, "workeroutput"):
        config.workeroutput["fault_cases"] = {"case_of": _case_of, "deselected": sorted(_deselected)}


def node_down(node):
    """On xdist's controller: what a worker's collection found (the same on every worker)."""
    found = getattr(node, "workeroutput", {}).get("fault_cases")
    if found:
        _case_of.update({nodeid: tuple(numbers) for nodeid, numbers in found["case_of"].items()})
        _deselected.update(found["deselected"])


def _plain_nodeid(nodeid: str) -> str:
    """A test's id without the "@group" xdist's loadgroup appends to it."""
    test = nodeid.rsplit("::", 1)[-1]
    return nodeid.rsplit("@", 1)[0] if "@" in test else nodeid


def _outcomes(terminalreporter) -> tuple[dict[str, str], dict[str, str]]:
    """Each test's outcome (failed in any phase over xfailed over skipped over passed), and why each xfailed."""
    rank = {"passed": 0, "skipped": 1, "xfailed": 2, "failed": 3, "error": 3, "xpassed": 3}
    found: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for key, reports in terminalreporter.stats.items():
        if key not in rank:
            continue
        for report in reports:
            nodeid = _plain_nodeid(getattr(report, "nodeid", None) or "")
            if not nodeid or (key == "passed" and getattr(report, "when", "call") != "call"):
                continue
            outcome = "failed" if key in ("error", "xpassed") else key
            if key == "xfailed":
                reasons[nodeid] = getattr(report, "wasxfail", "")
            if nodeid not in found or rank[outcome] > rank[found[nodeid]]:
                found[nodeid] = outcome
    return found, reasons


def _belongs(nodeid: str, reused: str) -> bool:
    return nodeid == reused or nodeid.startswith((reused + "[", reused + "::"))


def summary(terminalreporter):
    """The table of cases, where fault tests were collected (on xdist's controller, not its workers)."""
    if hasattr(terminalreporter.config, "workerinput") or not _case_of:
        return
    outcomes, reasons = _outcomes(terminalreporter)
    line = terminalreporter.write_line
    pad = f"{'':>4}  {'':<8}  {'':<28}  "
    terminalreporter.write_sep("=", "fault suite: cases")
    line(f"{'case':>4}  {'result':<8}  {'tests':<28}  what")
    for case in CASES:
        own = [n for n, numbers in _case_of.items() if case.number in numbers]
        reused = [n for n in outcomes if any(_belongs(n, r) for r in case.reused)]
        ran = {n: outcomes[n] for n in own + reused if n in outcomes}
        kinds = ("passed", "failed", "xfailed", "skipped")
        counts = {kind: sum(1 for o in ran.values() if o == kind) for kind in kinds}
        waiting = [n for n in own if n in _deselected]
        if counts["failed"]:
            result = "FAIL"
        elif counts["xfailed"]:
            result = "DEFECT"  # a defect the case found, its test kept failing (strict xfail) until it is fixed
        elif counts["skipped"]:
            result = "SKIPPED"
        elif ran:
            result = "pass"
        else:
            result = "waiting" if case.pending and not own else "not run"
        tests = ", ".join(f"{count} {kind}" for kind, count in counts.items() if count) or "-"
        if waiting:
            tests += f"; {len(waiting)} in make faults"
        line(f"{case.number:>4}  {result:<8}  {tests:<28}  {case.title}")
        for nodeid in sorted(n for n in ran if ran[n] == "xfailed"):
            line(f"{pad}known defect: {reasons.get(nodeid, '').removeprefix('reason: ')} ({nodeid.split('::')[-1]})")
        if case.pending:
            line(f"{pad}still needs: {case.pending}")
        if result == "not run" and case.reused and not reused:
            line(f"{pad}(the tests it reuses were not in this session)")
