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
import time
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


# The fact cache of every run (run_playbook).
FACT_CACHE = "memory"


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
    recap: bool = True  # whether the play reached its recap; if not, stats are the results that came in

    def host_failures(self, host: str) -> list[HostFailure]:
        return [f for f in self.failures if f.host == host]

    @property
    def private_data_dir(self) -> Path:
        return self.artifact_dir.parent.parent


# Ansible's whole message for a command that exited non-zero: the command's own words are in its output.
GENERIC_COMMAND_MESSAGE = "non-zero return code"


def _failure_message(result: dict) -> str:
    message = result.get("msg") or result.get("stderr") or result.get("module_stderr") or ""
    if isinstance(message, list):
        message = "\n".join(str(m) for m in message)
    message = str(message).strip()
    if message == GENERIC_COMMAND_MESSAGE:
        said = str(result.get("stderr") or result.get("stdout") or "").strip()
        if said:
            message = f"{message} (rc {result.get('rc')}): {said}"
    return message


# The recap as ansible-runner names it ("dark" is unreachable).
RUNNER_STAT_KEYS = {"unreachable": "dark"}


def _stats_from(event_data: dict) -> dict[str, dict[str, int]]:
    """The recap by host, from Runner.stats or the playbook_on_stats event's data (the same columns)."""
    columns = {key: event_data.get(RUNNER_STAT_KEYS.get(key, key)) or {} for key in STAT_KEYS}
    hosts = set((event_data.get("processed") or {}).keys())
    for column in columns.values():
        hosts.update(column.keys())
    return {h: {key: int(column.get(h, 0)) for key, column in columns.items()} for h in sorted(hosts)}


# A task's result events, by the recap column each counts in (as ansible's own stats count them).
RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failures",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}


def stats_from_events(events: Iterable[dict]) -> dict[str, dict[str, int]]:
    """The recap by host from the task results that came in: what a run that never reached its recap did."""
    stats: dict[str, dict[str, int]] = {}
    for event in events:
        column = RESULT_EVENTS.get(event.get("event", ""))
        data = event.get("event_data") or {}
        host = data.get("host")
        if column is None or not host:
            continue
        row = stats.setdefault(host, dict.fromkeys(STAT_KEYS, 0))
        res = data.get("res") if isinstance(data.get("res"), dict) else {}
        if column == "failures" and data.get("ignore_errors"):
            row["ok"] += 1
            row["ignored"] += 1
            continue
        row[column] += 1
        if column == "ok" and res.get("changed"):
            row["changed"] += 1
    return dict(sorted(stats.items()))


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


# How long ansible-playbook has to end its workers after the signal p40fleet passes on, before ansible-runner's
# SIGKILL of its process group; a second Ctrl-C cuts it short.
INTERRUPT_GRACE_S = 15.0
# How often ansible-runner asks whether the run is cancelled (its default, 5 s, left workers running that long).
CANCEL_POLL_S = 0.25


class _Interrupt:
    """SIGINT and SIGTERM during a run: the signal is passed on to ansible-playbook, whose own handler passes it to
    its workers. They run in sessions of their own (ansible's WorkerProcess calls setsid), so ansible-runner's
    cancel, a SIGKILL of ansible-playbook's process group, left them running with their SSH sessions and commands.
    `cancel` (ansible-runner's cancel_callback) says yes, and so lets that SIGKILL happen, only when the grace
    period is over, when a second signal came, or when ansible-playbook's pid is not known yet (no worker then)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.pid: int | None = None  # ansible-playbook's, from its first event
        self.passed: set[int] = set()
        self.deadline: float | None = None

    def on_event(self, event: dict) -> None:
        if self.pid is None and isinstance(event.get("pid"), int):
            self.pid = event["pid"]
            self._pass_on()

    def on_signal(self, number: int, frame=None) -> None:
        self.received.append(number)
        grace = INTERRUPT_GRACE_S if len(self.received) == 1 else 0.0
        self.deadline = time.monotonic() + grace
        self._pass_on()

    def _pass_on(self) -> None:
        if self.pid is None or not self.received or self.received[-1] in self.passed:
            return
        if not _is_our_child(self.pid):
            return  # ended (and reaped) already: the pid may be another process's by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, self.received[-1])
        self.passed.add(self.received[-1])

    def cancel(self) -> bool:
        if not self.received:
            return False
        self._pass_on()
        return self.pid is None or time.monotonic() >= (self.deadline or 0.0)


def _is_our_child(pid: int) -> bool:
    """Whether pid is a child of this process (ansible-runner's ansible-playbook); where /proc is missing, the pid
    came from that child's own event while the run goes on."""
    stat = Path(f"/proc/{pid}/stat")
    try:
        fields = stat.read_text(encoding="utf-8", errors="replace").rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return not Path("/proc/self").exists()
    except (OSError, IndexError):
        return False
    # After the name: state, ppid. A zombie is not signalled (it has ended).
    return fields[0] != "Z" and int(fields[1]) == os.getpid()


@contextlib.contextmanager
def _cancelled_by_signals() -> Iterator[_Interrupt | None]:
    """SIGINT and SIGTERM end the run (_Interrupt) with the signal's own exit code (python/p40fleet/exit_codes.py).
    ansible-runner's own signal_handler keeps its handlers for good, so a second Ctrl-C after the run did nothing;
    these are put back when the run ends."""
    if threading.current_thread() is not threading.main_thread():
        yield None  # only the main thread may set handlers; the caller's own stay in charge
        return
    interrupt = _Interrupt()
    kept = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    for number in kept:
        signal.signal(number, interrupt.on_signal)
    try:
        yield interrupt
    finally:
        for number, handler in kept.items():
            signal.signal(number, handler)


def _close_exited_without_pause() -> None:
    """ptyprocess's close() sleeps 0.1 s "to give the kernel time to update process status" before it checks the
    child. ansible-runner closes the child only after `isalive()` has reaped it and its last output was read, so
    that pause is pure waiting on every run (docs/benchmarks-overhead.md). A child already reaped is closed without
    it; a live one keeps the pause and the terminate that follows. Installed once, for the whole process."""
    import ptyprocess

    original = ptyprocess.PtyProcess.close
    if getattr(original, "p40fleet_exited_without_pause", False):
        return

    def close(self, force: bool = True) -> None:
        if self.terminated:
            self.delayafterclose = 0
        original(self, force)

    close.p40fleet_exited_without_pause = True  # type: ignore[attr-defined]
    ptyprocess.PtyProcess.close = close


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

    _close_exited_without_pause()
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
    interrupt: _Interrupt | None = None

    def on_event(event: dict) -> bool:
        events.append(event)
        if interrupt is not None:
            interrupt.on_event(event)
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
    # Facts live for one run, in memory, as ansible.cfg's own runs keep them (docs/privileges.md), whatever cache
    # the caller's environment names; a caller's envvars may still name another. ansible-runner's default, a
    # jsonfile cache in the run's artifacts, overrode both and cost a converged 4-host site.yml about 0.5 s of
    # controller CPU over plain ansible-playbook (docs/benchmarks-overhead.md).
    env["ANSIBLE_CACHE_PLUGIN"] = (envvars or {}).get("ANSIBLE_CACHE_PLUGIN", FACT_CACHE)
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
            fact_cache_type=FACT_CACHE,
        )
        config.prepare()
        # ansible-runner seeds the run's environment with all of ours: keep only what ansible
        # needs (and what ansible-runner itself set for its callback).
        config.env = {k: v for k, v in config.env.items() if k in env or k not in os.environ or os.environ[k] != v}
        config.pexpect_timeout = CANCEL_POLL_S
        interrupt = stack.enter_context(_cancelled_by_signals())
        cancel = interrupt.cancel if interrupt is not None else None
        runner = ansible_runner.Runner(config, event_handler=on_event, status_handler=on_status, cancel_callback=cancel)
        runner.run()
    finished = now()
    received = interrupt.received if interrupt is not None else []
    # ansible-runner's own recap, by host; when the play never reached it (a signal, a crash), what the hosts'
    # results said until then.
    recap = runner.stats is not None
    stats = _stats_from(runner.stats) if recap else stats_from_events(events)
    with runner.stdout as handle:
        stdout = handle.read()
    inventory_state.rotate(keep)
    return RunResult(
        rc=runner.rc,
        # ansible-playbook that ended on the signal passed on exits 99 or -2, which ansible-runner calls failed.
        status="canceled" if received else runner.status,
        stats=stats,
        failures=failures,
        stdout=stdout,
        artifact_dir=Path(runner.config.artifact_dir),
        events=events,
        run_id=run_id,
        started=started,
        finished=finished,
        signal=received[0] if received else None,
        recap=recap,
    )


def published(events: Iterable[dict], fact: str) -> Iterator[dict]:
    """Each mapping a host's task published as `fact` (a runner_on_ok's ansible_facts), in event order."""
    for event in events:
        res = event.get("event_data", {}).get("res")
        facts = res.get("ansible_facts") if isinstance(res, dict) else None
        value = facts.get(fact) if isinstance(facts, dict) else None
        if event.get("event") == "runner_on_ok" and isinstance(value, dict):
            yield value
