"""`p40fleet train start|stop|status`: the fleet's training runs through playbooks/train.yml (roles/train_run), one
run per host or one job on a Ray cluster. Each action ends with every run's status as the hosts published it
(step, seconds per step, train and validation score, checkpoint, expected end, a reboot under the run); the last
status of each run is kept in the inventory's state directory for `p40fleet report`.

    import p40fleet.train
    result = p40fleet.train.train("inventory/hosts.yml", "start", extra_vars={"train_run_name": "lr-sweep"})
    for run in result.runs:
        print(run["host"], run["state"], run["progress"]["step"])
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p40fleet.paths import PLAYBOOKS_DIR
from p40fleet.progress import printable
from p40fleet.run import RunResult, published, run_playbook
from p40fleet.state import StateDir

TRAIN_PLAYBOOK = PLAYBOOKS_DIR / "train.yml"
STATUS_FACT = "train_run_status"
SCHEMA = "p40fleet.train-runs/v1"
RUNS_FILE = "train-runs.json"
ACTIONS = ("start", "stop", "status")
# A run in these states needs the operator: `status` exits non-zero.
TROUBLE = ("failed", "rebooted")
# The network measurement's verdicts (plugins/filter/ray_cluster_network.py); anything else is shown as an error.
NETWORK_VERDICTS = ("pass", "warn", "fail", "error", "skip")


@dataclass
class TrainResult:
    run: RunResult
    runs: list[dict]


def statuses(events: Iterable[dict]) -> list[dict]:
    """Each run's status as its host published it in a run (the last one per host and run name)."""
    found: dict[tuple[str, str], dict] = {}
    for status in published(events, STATUS_FACT):
        if status.get("host"):
            found[(status["host"], str(status.get("name", "")))] = status
    return [found[key] for key in sorted(found)]


def runs_path(state: StateDir, inventory: Path | str) -> Path:
    return state.inventory(inventory).dir / RUNS_FILE


def saved_runs(state: StateDir, inventory: Path | str) -> list[dict]:
    """The last status of every run `p40fleet train` has seen for this inventory (for the report)."""
    try:
        data = json.loads(runs_path(state, inventory).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    return [r for r in data.get("runs", []) if isinstance(r, dict)]


def save_runs(state: StateDir, inventory: Path | str, runs: list[dict], at: str) -> None:
    """Keep the new statuses over the saved ones, by host and run name."""
    kept = {(r.get("host"), r.get("name")): r for r in saved_runs(state, inventory)}
    for run in runs:
        kept[(run.get("host"), run.get("name"))] = {**run, "seen": at}
    state.inventory(inventory).ensure()
    path = runs_path(state, inventory)
    tmp = path.with_name(f".{path.name}.tmp")
    document = {"schema": SCHEMA, "runs": [kept[key] for key in sorted(kept, key=lambda k: (str(k[0]), str(k[1])))]}
    tmp.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)


def refusals(inventory: Path | str, limit: str | None = None) -> list[str]:
    """What refuses a training action before any host is contacted: an inventory ansible cannot read, a limit that
    matches no host of it, or a role's copy of a shared setting (conda_env_owner, ...) that differs from it, as
    `p40fleet run` refuses them: the runs would start as another owner than the env's."""
    from p40fleet.inputs import InventoryError, limit_problem, load_inventory, shared_setting_problems
    from p40fleet.run import ansible_env

    inventory = Path(inventory).resolve()
    try:
        listed = load_inventory(inventory, ansible_env(inventory), limit, playbook_dir=TRAIN_PLAYBOOK.parent)
    except InventoryError as error:
        return [str(error)]
    if limit and not listed.hosts:
        return [limit_problem(inventory, limit)]
    return shared_setting_problems(listed, listed.hosts, {})


def train(
    inventory: Path | str,
    action: str = "status",
    limit: str | None = None,
    extra_vars: Mapping | None = None,
    become_password_file: Path | str | None = None,
    state_dir: StateDir | Path | str | None = None,
) -> TrainResult:
    if action not in ACTIONS:
        raise ValueError(f"action {action!r}: one of {', '.join(ACTIONS)}")
    inventory = Path(inventory).resolve()
    state = state_dir if isinstance(state_dir, StateDir) else StateDir(state_dir)
    cmdline = ["--limit", limit] if limit else []
    run = run_playbook(
        TRAIN_PLAYBOOK,
        inventory,
        cmdline=cmdline,
        extravars={**(extra_vars or {}), "train_run_action": action},
        become_password_file=become_password_file,
        state_dir=state,
    )
    runs = statuses(run.events)
    save_runs(state, inventory, runs, datetime.now(UTC).isoformat(timespec="seconds"))
    return TrainResult(run, runs)


def _number(value, form="{:.3f}") -> str:
    return form.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _duration(seconds) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    minutes, _ = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m"


def step_text(progress: dict) -> str:
    """Step X of Y, as far as the log said: "12 of 100", "12 (total not logged yet)", "-" before the first step."""
    step, total = progress.get("step"), progress.get("total_steps")
    if not isinstance(step, int) or isinstance(step, bool):
        return "-"
    return f"{step} of {total}" if isinstance(total, int) and not isinstance(total, bool) else f"{step} (of ?)"


def state_text(run: dict) -> str:
    """The run's state, a resumed run marked with how many times its trainer started again (from its log)."""
    resumes = (run.get("progress") or {}).get("resumes")
    state = str(run.get("state", ""))
    if isinstance(resumes, int) and not isinstance(resumes, bool) and resumes > 0:
        state += f" (resumed{f' {resumes}x' if resumes > 1 else ''})"
    return state


def row(run: dict, wide: bool = False) -> list[str]:
    """One run as the table shows it (`wide`: with where it started and its log); every field came from a host,
    so it is made printable."""
    progress = run.get("progress") or {}
    end = progress.get("expected_end")
    cells = [
        run.get("host", ""),
        run.get("name", ""),
        state_text(run),
        step_text(progress),
        _number(progress.get("seconds_per_step"), "{:.1f}"),
        _number(progress.get("train_score")),
        _number(progress.get("val_score")) + (f" @{progress['val_step']}" if progress.get("val_step") else ""),
        _number(progress.get("checkpoint_step"), "{}"),
        (
            datetime.fromtimestamp(end, UTC).strftime("%Y-%m-%d %H:%M") + f" ({_duration(progress.get('remaining_s'))})"
            if isinstance(end, (int, float)) and run.get("state") == "running"
            else "-"
        ),
    ]
    if wide:
        cells += [run.get("started") or "-", f"{run.get('head') or run.get('host', '')}:{run.get('log') or '-'}"]
    return [printable(str(c)) for c in cells]


COLUMNS = ("host", "run", "state", "step", "s/step", "train score", "val score", "checkpoint", "expected end")
WIDE_COLUMNS = (*COLUMNS, "started", "log")


def network(run: dict) -> tuple[str, str]:
    """The network measured before a cluster job (roles/ray_cluster's result, kept in the run's record): its verdict
    (pass, warn, fail or error) and message, ('', '') where none was measured; made printable, it came from a host."""
    found = run.get("network")
    if not isinstance(found, dict) or not found.get("message"):
        return "", ""
    verdict = str(found.get("verdict", ""))
    return (verdict if verdict in NETWORK_VERDICTS else "error"), printable(str(found["message"]))


def print_runs(console: Console, runs: list[dict], wide: bool = False) -> None:
    """A table on a terminal (`wide`: with where each run started and its log); elsewhere one line per run with
    every column and the log, never cut to a width."""
    if not runs:
        console.print("No training run: `p40fleet train start` starts one per host.")
        return
    if console.is_terminal:
        table = Table(title=f"{len(runs)} run(s)", title_justify="left")
        for column in WIDE_COLUMNS if wide else COLUMNS:
            table.add_column(column, overflow="fold")
        for run in runs:
            table.add_row(*(escape(c) for c in row(run, wide)))
        console.print(table)
    else:
        console.out(f"{len(runs)} run(s)", highlight=False)
        for run in runs:
            cells = dict(zip(WIDE_COLUMNS, row(run, wide=True), strict=True))
            said = " · ".join(f"{k} {v}" for k, v in cells.items() if k not in ("host", "run", "state") and v != "-")
            console.out(f"  {cells['host']} {cells['run']}: {cells['state']} · {said}", highlight=False)
    for run in runs:
        if run.get("why") and run.get("state") != "member":
            _say(console, "", f"  {printable(run['host'])}: {printable(run['why'])}")
        verdict, message = network(run)
        if message:
            _say(console, {"pass": "green", "warn": "yellow"}.get(verdict, "red"), f"  network {verdict}: {message}")


def _say(console: Console, color: str, text: str) -> None:
    """A line under the table: coloured on a terminal, whole elsewhere (never wrapped or cut)."""
    if console.is_terminal and color:
        console.print(f"[{color}]{escape(text)}[/]", highlight=False)
    elif console.is_terminal:
        console.print(escape(text), highlight=False)
    else:
        console.out(text, highlight=False)


def write_json(runs: list[dict], path: Path) -> None:
    """The runs as JSON (p40fleet.train-runs/v1) in the file, or on standard output for `-`."""
    text = json.dumps({"schema": SCHEMA, "runs": runs}, indent=2) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        path.write_text(text, encoding="utf-8")
