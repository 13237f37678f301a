"""`p40fleet cluster status`: each Ray cluster of an inventory as its head's Ray reports it
(playbooks/cluster_status.yml, read-only): members alive or not with their GPUs, nodes alive that are no
member, and the last job and its state."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p40fleet.paths import PLAYBOOKS_DIR
from p40fleet.run import RunResult, published, run_playbook

STATUS_PLAYBOOK = PLAYBOOKS_DIR / "cluster_status.yml"
STATUS_FACT = "ray_cluster_status"
SCHEMA = "p40fleet.cluster-status/v1"


def statuses(events: Iterable[dict]) -> dict[str, dict]:
    """Each cluster's status as its head published it in a run, by cluster name."""
    found: dict[str, dict] = {}
    for status in published(events, STATUS_FACT):
        if status.get("cluster"):
            found[status["cluster"]] = status
    return found


def cluster_status(inventory: Path | str, become_password_file: Path | str | None = None) -> tuple[RunResult, dict]:
    run = run_playbook(STATUS_PLAYBOOK, Path(inventory).resolve(), become_password_file=become_password_file)
    return run, statuses(run.events)


def document(clusters: dict[str, dict]) -> dict:
    return {"schema": SCHEMA, "clusters": [clusters[name] for name in sorted(clusters)]}


def print_status(console: Console, clusters: dict[str, dict]) -> None:
    if not clusters:
        console.print("No Ray cluster: no host has p40fleet_cluster (or no head answered).")
    for name in sorted(clusters):
        status = clusters[name]
        members = status["members"]
        alive = sum(1 for m in members if m["alive"])
        table = Table(
            title=f"cluster {escape(name)}: {alive}/{len(members)} alive, "
            f"{status['gpus']:g}/{status['gpus_wanted']} GPUs, head {escape(status['head'])}",
            title_justify="left",
        )
        for column in ("member", "alive", "GPUs", "address", "role"):
            table.add_column(column)
        for member in members:
            table.add_row(
                escape(member["name"]),
                "[red]not its node[/]"
                if member.get("mismatch")
                else "[green]alive[/]"
                if member["alive"]
                else "[red]not alive[/]",
                f"{member['gpus']:g}",
                escape(member["ip"]),
                "head" if member["head"] else "worker",
            )
        console.print(table)
        for member in members:
            if member.get("mismatch"):
                console.print(f"  [red]{escape(member['name'])}: {escape(member['mismatch'])}[/]", highlight=False)
            if member.get("firewall"):
                console.print(f"  [red]{escape(member['firewall'])}[/]", highlight=False)
        if status["strays"]:
            console.print(f"  also alive, not members: {escape(', '.join(status['strays']))}")
        job = status.get("last_job")
        console.print(
            f"  last job: {escape(job['id'])} {job['status']}" if job else "  last job: none submitted yet",
            highlight=False,
        )
        if status.get("error"):
            console.print(f"  [red]{escape(status['error'])}[/]")


def write_json(clusters: dict[str, dict], path: Path) -> None:
    path.write_text(json.dumps(document(clusters), indent=2) + "\n", encoding="utf-8")
