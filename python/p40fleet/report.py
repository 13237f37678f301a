"""Progress per host while a run goes, then a summary table and a machine-readable report."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

REPORT_SCHEMA = "p40fleet.report/v1"


class Progress:
    """Prints one line per host and task outcome that matters (changed, failed, unreachable), and
    one line per stage as it starts; ok and skipped results stay quiet."""

    def __init__(self, console: Console, label: str) -> None:
        self.console = console
        self.label = label

    def __call__(self, event: dict) -> None:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host", "")
        task = data.get("task", "")
        role = data.get("role", "")
        where = escape(f"[{role}] {task}" if role else task)
        if kind == "playbook_on_play_start":
            self.console.print(f"[bold]{self.label}[/] · {data.get('play', '')}")
        elif kind == "runner_on_ok" and data.get("res", {}).get("changed"):
            self.console.print(f"  [yellow]changed[/]     {host:10} {where}")
        elif kind == "runner_on_failed" and not data.get("ignore_errors"):
            message = str(data.get("res", {}).get("msg", "")).splitlines()[:1]
            self.console.print(f"  [red]failed[/]      {host:10} {where}: {escape(' '.join(message))}")
        elif kind == "runner_on_unreachable":
            self.console.print(f"  [red]unreachable[/] {host:10} {where}")


def _host_state(stats: dict[str, int]) -> str:
    if stats["unreachable"]:
        return "unreachable"
    if stats["failures"]:
        return "failed"
    return "changed" if stats["changed"] else "ok"


def build_report(runs: list[tuple[str, object]]) -> dict:
    """One entry per run, each with per-host stats, state and failures (task, role, message)."""
    report = {"schema": REPORT_SCHEMA, "generated": datetime.now(UTC).isoformat(), "runs": []}
    for label, result in runs:
        hosts = {}
        for host, stats in result.stats.items():
            hosts[host] = {
                "state": _host_state(stats),
                "stats": stats,
                "failures": [
                    {"task": f.task, "role": f.role, "message": f.message, "unreachable": f.unreachable}
                    for f in result.host_failures(host)
                ],
            }
        report["runs"].append(
            {
                "label": label,
                "rc": result.rc,
                "status": result.status,
                "artifact_dir": str(result.artifact_dir),
                "hosts": hosts,
            }
        )
    return report


def print_summary(console: Console, report: dict) -> None:
    for run in report["runs"]:
        table = Table(title=f"p40fleet · {run['label']} · {run['status']} (rc {run['rc']})")
        for column in ("host", "state", "ok", "changed", "failed", "unreachable", "skipped", "first failure"):
            table.add_column(column)
        for host, entry in run["hosts"].items():
            stats = entry["stats"]
            colour = {"ok": "green", "changed": "yellow"}.get(entry["state"], "red")
            first = entry["failures"][0] if entry["failures"] else None
            table.add_row(
                host,
                f"[{colour}]{entry['state']}[/]",
                str(stats["ok"]),
                str(stats["changed"]),
                str(stats["failures"]),
                str(stats["unreachable"]),
                str(stats["skipped"]),
                escape(f"{first['task']}: {(first['message'].splitlines() or [''])[0]}") if first else "",
            )
        console.print(table)


def write_report(report: dict, path: Path | None) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
