"""Run a playbook through ansible-runner and keep what a report needs: per-host stats and failures."""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import ansible_runner

from p40fleet.paths import ANSIBLE_CONFIG, REPO_ROOT, RUNS_DIR

STAT_KEYS = ("ok", "changed", "failures", "unreachable", "skipped", "rescued", "ignored")


class RunError(RuntimeError):
    pass


# Opt-in: P40FLEET_MITOGEN=1 runs the playbook with mitogen's linear strategy (pip install -c constraints.txt
# mitogen). make bench measures it (--mitogen); README says what it gains and what it rests on.
MITOGEN_SWITCH = "P40FLEET_MITOGEN"
MITOGEN_ON = ("1", "true", "yes", "on")
MITOGEN_OFF = ("", "0", "false", "no", "off")


def mitogen_envvars(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The Ansible settings that select mitogen when P40FLEET_MITOGEN asks for it, else none."""
    environ = os.environ if environ is None else environ
    value = environ.get(MITOGEN_SWITCH, "")
    if value.strip().lower() in MITOGEN_OFF:
        return {}
    if value.strip().lower() not in MITOGEN_ON:
        raise RunError(
            f"{MITOGEN_SWITCH}={value!r}: set it to 1 to run with mitogen, or to 0 (or unset it) to run without"
        )
    spec = importlib.util.find_spec("ansible_mitogen")
    if spec is None or spec.origin is None:
        raise RunError(
            f"{MITOGEN_SWITCH}={value} asks for mitogen, which is not installed here: "
            "pip install -c constraints.txt mitogen (or unset it)"
        )
    strategies = Path(spec.origin).parent / "plugins" / "strategy"
    return {"ANSIBLE_STRATEGY_PLUGINS": str(strategies), "ANSIBLE_STRATEGY": "mitogen_linear"}


@dataclass
class HostFailure:
    host: str
    task: str
    role: str
    message: str
    unreachable: bool = False


@dataclass
class RunResult:
    rc: int
    status: str
    stats: dict[str, dict[str, int]]
    failures: list[HostFailure]
    stdout: str
    artifact_dir: Path
    events: list[dict] = field(repr=False, default_factory=list)

    def host_failures(self, host: str) -> list[HostFailure]:
        return [f for f in self.failures if f.host == host]


def _failure_message(result: dict) -> str:
    message = result.get("msg") or result.get("stderr") or result.get("module_stderr") or ""
    if isinstance(message, list):
        message = "\n".join(str(m) for m in message)
    return str(message).strip()


# The recap as ansible-runner names it ("dark" is unreachable).
RUNNER_STAT_KEYS = {"unreachable": "dark"}


def _stats_from(event_data: dict) -> dict[str, dict[str, int]]:
    columns = {key: event_data.get(RUNNER_STAT_KEYS.get(key, key)) or {} for key in STAT_KEYS}
    hosts = set((event_data.get("processed") or {}).keys())
    for column in columns.values():
        hosts.update(column.keys())
    return {h: {key: int(column.get(h, 0)) for key, column in columns.items()} for h in sorted(hosts)}


def run_playbook(
    playbook: Path | str,
    inventory: Path | str,
    cmdline: Sequence[str] = (),
    extravars: dict | None = None,
    envvars: dict | None = None,
    progress: Callable[[dict], None] | None = None,
    keep_artifacts: int = 5,
    become_password_file: Path | str | None = None,
) -> RunResult:
    """Run one playbook; never raises for host failures, only when ansible could not run at all.

    A sudo password is given as a file that ansible-playbook reads itself (--become-password-file):
    only its path reaches ansible-runner, so the password is in no artifact (command, env, job
    events, stdout)."""
    bin_dir = str(Path(sys.executable).parent)
    if shutil.which("ansible-playbook", path=bin_dir + os.pathsep + os.environ.get("PATH", "")) is None:
        raise RunError("ansible-playbook not found: run `make deps`")
    cmdline = list(cmdline)
    if become_password_file is not None:
        password_file = Path(become_password_file).resolve()
        if not password_file.is_file() or not os.access(password_file, os.R_OK):
            raise RunError(f"become password file {password_file} is not a readable file")
        mode = password_file.stat().st_mode & 0o777
        if mode & 0o077:
            raise RunError(
                f"become password file {password_file} is open to other users (mode {mode:04o}): chmod 600 it"
            )
        cmdline += ["--become-password-file", str(password_file)]
    RUNS_DIR.mkdir(parents=True, exist_ok=True)
    private_data_dir = Path(tempfile.mkdtemp(dir=RUNS_DIR, prefix="run-"))
    events: list[dict] = []
    failures: list[HostFailure] = []

    def on_event(event: dict) -> bool:
        events.append(event)
        data = event.get("event_data", {})
        kind = event.get("event", "")
        if kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            failures.append(
                HostFailure(
                    host=data.get("host", "?"),
                    task=data.get("task", "?"),
                    role=data.get("role", ""),
                    message=_failure_message(data.get("res", {})),
                    unreachable=kind == "runner_on_unreachable",
                )
            )
        if progress is not None:
            progress(event)
        return True  # ansible-runner keeps the event (and its stats) only when this is truthy

    env = {
        "ANSIBLE_CONFIG": str(ANSIBLE_CONFIG),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "ANSIBLE_FORCE_COLOR": "0",
        # ansible-runner turns host key checking off unless told otherwise; p40fleet never does.
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        **mitogen_envvars(),
        **(envvars or {}),
    }
    inventory = Path(inventory).resolve()
    if inventory.is_relative_to(REPO_ROOT / ".sandbox"):
        # Sandboxes reuse host names (node1...): keep their fact caches apart.
        env.setdefault("ANSIBLE_CACHE_PLUGIN_CONNECTION", str(inventory.parent / "fact_cache"))
    runner = ansible_runner.run(
        private_data_dir=str(private_data_dir),
        playbook=str(Path(playbook).resolve()),
        inventory=str(inventory),
        cmdline=shlex.join(cmdline) if cmdline else None,
        extravars=extravars or {},
        envvars=env,
        event_handler=on_event,
        quiet=True,
        suppress_env_files=True,
        rotate_artifacts=keep_artifacts,
    )
    stats: dict[str, dict[str, int]] = {}
    for event in events:
        if event.get("event") == "playbook_on_stats":
            stats = _stats_from(event.get("event_data", {}))
    stdout = runner.stdout.read() if runner.stdout else ""
    return RunResult(
        rc=runner.rc,
        status=runner.status,
        stats=stats,
        failures=failures,
        stdout=stdout,
        artifact_dir=Path(runner.config.artifact_dir),
        events=events,
    )
