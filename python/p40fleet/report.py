"""The summary after a run and the machine-readable report of it (schema p40fleet.report/v1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from p40fleet.exit_codes import meaning
from p40fleet.progress import one_line
from p40fleet.state import now

if TYPE_CHECKING:
    from rich.console import Console

REPORT_SCHEMA = "p40fleet.report/v1"
STATE_COLOURS = {"ok": "green", "changed": "yellow", "failed": "red", "unreachable": "magenta", "interrupted": "cyan"}


def _failure(f) -> dict:
    return {"task": f.task, "role": f.role, "message": f.message, "unreachable": f.unreachable}


def run_entry(label: str, result) -> dict:
    """One run (a ProvisionResult) as the report keeps it."""
    return {
        "label": label,
        "run_id": result.run_id,
        "inventory": str(result.inventory),
        "playbook": str(result.playbook),
        "limit": result.limit,
        "tags": result.tags,
        "check": result.check,
        "started": result.started,
        "finished": result.finished,
        "rc": result.rc,
        "status": result.status,
        "exit_code": int(result.exit_code),
        "artifact_dir": str(result.artifact_dir) if result.artifact_dir else None,
        "problems": list(result.problems),
        "message": result.message,
        "hosts": {
            host: {
                "state": entry.state,
                "stats": dict(vars(entry.stats)),
                "failures": [_failure(f) for f in entry.failures],
            }
            for host, entry in result.hosts.items()
        },
    }


def build_report(runs: list[tuple[str, object]]) -> dict:
    """One entry per run, each with per-host state, stats and failures (task, role, message)."""
    return {"schema": REPORT_SCHEMA, "generated": now(), "runs": [run_entry(label, r) for label, r in runs]}


def _first_failure(entry: dict) -> dict | None:
    if entry["state"] in ("failed", "unreachable") and entry["failures"]:
        return entry["failures"][0]
    return None


def print_summary(console: Console, report: dict, plain: bool | None = None) -> None:
    """A table on a terminal; elsewhere plain lines that keep every column and every word, then each
    host's first failure verbatim."""
    plain = not console.is_terminal if plain is None else plain
    for run in report["runs"]:
        # p40fleet's exit code leads; ansible-playbook's own rc (4 for an unreachable host) only follows it.
        title = f"p40fleet · {run['label']} · exit {run['exit_code']}: {meaning(run['exit_code'])} ({run['status']}"
        title += f", ansible-playbook rc {run['rc']})" if run["rc"] is not None else ")"
        if plain:
            console.out(title, highlight=False)
            for host, entry in run["hosts"].items():
                stats = entry["stats"]
                counts = " ".join(
                    f"{key}={stats[key]}" for key in ("ok", "changed", "failures", "unreachable", "skipped", "rescued")
                )
                first = _first_failure(entry)
                line = f"  {host}: {entry['state']} {counts}"
                if first:
                    where = f"[{first['role']}] {first['task']}" if first["role"] else first["task"]
                    line += f" first failure: {where}: {one_line(first['message'])}"
                console.out(line, highlight=False)
        else:
            # rich only for the table: plain lines need none of it (python/p40fleet/output.py).
            from rich.markup import escape
            from rich.table import Table

            table = Table(title=escape(title))
            for column in ("host", "state", "ok", "changed", "failed", "unreachable", "skipped"):
                table.add_column(column, no_wrap=True)
            table.add_column("first failure", overflow="fold", ratio=1)
            for host, entry in run["hosts"].items():
                stats = entry["stats"]
                first = _first_failure(entry)
                table.add_row(
                    escape(host),
                    f"[{STATE_COLOURS.get(entry['state'], 'red')}]{entry['state']}[/]",
                    str(stats["ok"]),
                    str(stats["changed"]),
                    str(stats["failures"]),
                    str(stats["unreachable"]),
                    str(stats["skipped"]),
                    escape(f"{first['task']}: {(first['message'].splitlines() or [''])[0]}") if first else "",
                )
            console.print(table)
        for problem in run.get("problems", []):
            console.out(f"bad input: {problem}", highlight=False)
        if run.get("message"):
            console.out(run["message"], highlight=False)
        for host, entry in run["hosts"].items():
            first = _first_failure(entry)
            if first and "\n" in first["message"].strip():
                console.out(f"{host}: {first['task']}:", highlight=False)
                for line in first["message"].strip().splitlines():
                    console.out(f"    {line}", highlight=False)


def write_report(report: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
