"""Run a playbook through ansible-runner and keep what a report needs: per-host stats and failures.

Runner hygiene: each run gets its own private data dir under the state directory (outside the
repository), the last N of an inventory are kept. Nothing secret is handed to ansible-runner in a
form it writes down: extra vars go to ansible-playbook as `-e @FILE` (a 0600 file removed when the
run ends), a sudo password as `--become-password-file`, `env/` files are suppressed, and the
environment ansible-runner records (`artifacts/<id>/command`, the `starting` status) holds only what
ansible-playbook needs, with secret-looking values redacted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p40fleet.paths import ANSIBLE_CONFIG, COLLECTIONS_PATH
from p40fleet.state import StateDir, default_keep_runs, now

STAT_KEYS = ("ok", "changed", "failures", "unreachable", "skipped", "rescued", "ignored")

# What ansible-playbook and ssh need from the controller's environment; the rest stays behind.
PASSED_ENV = {
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "SSH_AUTH_SOCK",
    "XDG_RUNTIME_DIR",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
}
PASSED_ENV_PREFIXES = ("LC_", "ANSIBLE_")
# Redacted where ansible-runner writes the environment down (the child still gets the value).
SECRET_NAME = re.compile(r"PASS|TOKEN|SECRET|CREDENTIAL|PRIVATE|(?<!SSH_)AUTH(?!_SOCK)|(^|_)KEY$", re.I)
NOT_SECRET_NAME = re.compile(r"_(FILE|PATH|DIR|SOCK|PLUGINS|METHOD|EXE|USER)$", re.I)
URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
REDACTED = "**redacted by p40fleet**"


class RunError(RuntimeError):
    pass


# Opt-in: P40FLEET_MITOGEN=1 runs the playbook with mitogen's linear strategy (pip install -c constraints.txt
# mitogen). make bench measures it (--mitogen); docs/benchmarks-settings.md says what it gains and what it rests on.
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
    run_id: str = ""
    started: str = ""
    finished: str = ""
    signal: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run, if one did

    def host_failures(self, host: str) -> list[HostFailure]:
        return [f for f in self.failures if f.host == host]

    @property
    def private_data_dir(self) -> Path:
        return self.artifact_dir.parent.parent


def _failure_message(result: dict) -> str:
    message = result.get("msg") or result.get("stderr") or result.get("module_stderr") or ""
    if isinstance(message, list):
        message = "\n".join(str(m) for m in message)
    return str(message).strip()


# The recap as ansible-runner names it ("dark" is unreachable).
RUNNER_STAT_KEYS = {"unreachable": "dark"}


def _stats_from(event_data: dict) -> dict[str, dict[str, int]]:
    """The recap by host, from Runner.stats or the playbook_on_stats event's data (the same columns)."""
    columns = {key: event_data.get(RUNNER_STAT_KEYS.get(key, key)) or {} for key in STAT_KEYS}
    hosts = set((event_data.get("processed") or {}).keys())
    for column in columns.values():
        hosts.update(column.keys())
    return {h: {key: int(column.get(h, 0)) for key, column in columns.items()} for h in sorted(hosts)}


def failure_from_event(event: dict) -> HostFailure | None:
    data = event.get("event_data", {})
    kind = event.get("event", "")
    if kind not in ("runner_on_failed", "runner_on_unreachable") or data.get("ignore_errors"):
        return None
    return HostFailure(
        host=data.get("host", "?"),
        task=data.get("task", "?"),
        role=data.get("role", ""),
        message=_failure_message(data.get("res", {})),
        unreachable=kind == "runner_on_unreachable",
    )


def bin_dir() -> str:
    return str(Path(sys.executable).parent)


def ansible_env(inventory: Path, envvars: dict | None = None, pass_env: Iterable[str] = ()) -> dict[str, str]:
    """The environment ansible-playbook (and ansible-inventory) runs with: what it needs of ours,
    the variables asked for by name, and p40fleet's settings."""
    passed = set(pass_env)
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k in passed or k.startswith(PASSED_ENV_PREFIXES)}
    env.update(
        {
            "ANSIBLE_CONFIG": str(ANSIBLE_CONFIG),
            # p40fleet.fleet is this p40fleet's own copy, never one installed elsewhere (the roles use full names).
            "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS_PATH),
            "PATH": bin_dir() + os.pathsep + os.environ.get("PATH", os.defpath),
            "ANSIBLE_FORCE_COLOR": "0",
            # ansible-runner turns host key checking off unless told otherwise; p40fleet never does.
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            **mitogen_envvars(),
        }
    )
    env.update(envvars or {})
    return env


def redact_env(env: dict[str, str], secret_names: Iterable[str] = ()) -> dict[str, str]:
    secret = set(secret_names)
    redacted = {}
    for key, value in env.items():
        if key in secret or (SECRET_NAME.search(key) and not NOT_SECRET_NAME.search(key)):
            redacted[key] = REDACTED
        else:
            redacted[key] = URL_USERINFO.sub(lambda m: f"{m['scheme']}{REDACTED}@", value)
    return redacted


def _checked_password_file(become_password_file: Path | str) -> Path:
    password_file = Path(become_password_file).resolve()
    if not password_file.is_file() or not os.access(password_file, os.R_OK):
        raise RunError(f"become password file {password_file} is not a readable file")
    mode = password_file.stat().st_mode & 0o777
    if mode & 0o077:
        raise RunError(f"become password file {password_file} is open to other users (mode {mode:04o}): chmod 600 it")
    return password_file


@contextlib.contextmanager
def _cancelled_by_signals() -> Iterator[tuple[Callable[[], bool] | None, list[int]]]:
    """A cancel callback for ansible-runner that SIGINT and SIGTERM set, and the signals received: the run ends
    with the signal's own exit code (python/p40fleet/exit_codes.py). ansible-runner's own signal_handler keeps its
    handlers for good, so a second Ctrl-C after the run did nothing; these are put back when the run ends."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield None, received  # only the main thread may set handlers; the caller's own stay in charge
        return
    kept = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in kept:
        signal.signal(number, lambda number, frame: received.append(number))
    try:
        yield (lambda: bool(received)), received
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler)


def run_playbook(
    playbook: Path | str,
    inventory: Path | str,
    cmdline: Sequence[str] = (),
    extravars: dict | Sequence[dict | Path] | None = None,
    envvars: dict | None = None,
    progress: Callable[[dict], None] | None = None,
    become_password_file: Path | str | None = None,
    state_dir: StateDir | Path | str | None = None,
    keep_runs: int | None = None,
    pass_env: Iterable[str] = (),
) -> RunResult:
    """Run one playbook; never raises for host failures, only when ansible could not run at all.

    `extravars` (a mapping, or mappings and files in -e order) reach ansible-playbook as files
    (`-e @FILE`; a mapping is written to a 0600 file removed afterwards), and a sudo
    password as `--become-password-file`: only paths reach ansible-runner, so neither is in any
    artifact (command, env, job events, stdout). `pass_env` names further environment variables the
    play needs (their values are redacted in the artifacts)."""
    if shutil.which("ansible-playbook", path=bin_dir() + os.pathsep + os.environ.get("PATH", "")) is None:
        raise RunError("ansible-playbook not found: run `make deps`")
    # Imported here, not with the module: a quarter second of CPU that `--help`, a bad input and `p40fleet
    # report` never need (docs/benchmarks-overhead.md).
    import ansible_runner

    state = state_dir if isinstance(state_dir, StateDir) else StateDir(state_dir)
    keep = keep_runs if keep_runs is not None else default_keep_runs()
    inventory = Path(inventory).resolve()
    cmdline = list(cmdline)
    if become_password_file is not None:
        cmdline += ["--become-password-file", str(_checked_password_file(become_password_file))]
    pass_env = list(pass_env)
    inventory_state = state.inventory(inventory)
    run_id, private_data_dir = inventory_state.new_run()
    events: list[dict] = []
    failures: list[HostFailure] = []

    def on_event(event: dict) -> bool:
        events.append(event)
        failure = failure_from_event(event)
        if failure is not None:
            failures.append(failure)
        if progress is not None:
            progress(event)
        return True  # ansible-runner keeps the event (and its stats) only when this is truthy

    def on_status(status: dict, runner_config) -> None:
        # ansible-runner has written artifacts/<id>/command (with the environment) and not yet
        # started ansible-playbook: rewrite it without secret values before anything runs.
        if status.get("status") == "running":
            command_file = Path(runner_config.artifact_dir) / "command"
            if command_file.exists():
                recorded = json.loads(command_file.read_text(encoding="utf-8"))
                recorded["env"] = redact_env(recorded.get("env", {}), pass_env)
                command_file.write_text(json.dumps(recorded, ensure_ascii=False), encoding="utf-8")

    env = ansible_env(inventory, envvars, pass_env)
    started = now()
    items = [extravars] if isinstance(extravars, Mapping) else list(extravars or [])
    with contextlib.ExitStack() as stack:
        for item in items:
            if isinstance(item, Mapping):
                if item:
                    cmdline += ["-e", f"@{stack.enter_context(state.secret_json(dict(item)))}"]
            else:
                cmdline += ["-e", f"@{Path(item).resolve()}"]
        config = ansible_runner.RunnerConfig(
            private_data_dir=str(private_data_dir),
            ident=run_id,
            playbook=str(Path(playbook).resolve()),
            inventory=str(inventory),
            cmdline=shlex.join(cmdline) if cmdline else None,
            envvars=env,
            quiet=True,
            suppress_env_files=True,
            rotate_artifacts=0,
        )
        config.prepare()
        # ansible-runner seeds the run's environment with all of ours: keep only what ansible
        # needs (and what ansible-runner itself set for its callback).
        config.env = {k: v for k, v in config.env.items() if k in env or k not in os.environ or os.environ[k] != v}
        cancel, received = stack.enter_context(_cancelled_by_signals())
        runner = ansible_runner.Runner(config, event_handler=on_event, status_handler=on_status, cancel_callback=cancel)
        runner.run()
    finished = now()
    # ansible-runner's own recap (None when the play never reached it), by host.
    stats = _stats_from(runner.stats or {})
    with runner.stdout as handle:
        stdout = handle.read()
    inventory_state.rotate(keep)
    return RunResult(
        rc=runner.rc,
        status=runner.status,
        stats=stats,
        failures=failures,
        stdout=stdout,
        artifact_dir=Path(runner.config.artifact_dir),
        events=events,
        run_id=run_id,
        started=started,
        finished=finished,
        signal=received[0] if received else None,
    )


def published(events: Iterable[dict], fact: str) -> Iterator[dict]:
    """Each mapping a host's task published as `fact` (a runner_on_ok's ansible_facts), in event order."""
    for event in events:
        res = event.get("event_data", {}).get("res")
        facts = res.get("ansible_facts") if isinstance(res, dict) else None
        value = facts.get(fact) if isinstance(facts, dict) else None
        if event.get("event") == "runner_on_ok" and isinstance(value, dict):
            yield value
