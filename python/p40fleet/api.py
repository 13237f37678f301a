"""p40fleet as a library: `provision(...)` runs the playbook against an inventory and returns a
typed result; the `p40fleet run` command is a thin layer over it.

    import p40fleet
    result = p40fleet.provision("inventory/hosts.yml", limit="gpu-rack1-*", extra_vars={"apex_enabled": False})
    if result.exit_code:
        for failure in result.failures:
            print(failure.host, failure.task, failure.message)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from p40fleet import fleet
from p40fleet.exit_codes import Exit, for_signal
from p40fleet.inputs import ExtraVars, InventoryError, check_inputs, load_inventory, parse_extra_vars, typed
from p40fleet.lock import inventory_lock
from p40fleet.paths import SITE_PLAYBOOK
from p40fleet.run import HostFailure, RunError, RunResult, ansible_env, run_playbook
from p40fleet.state import StateDir, now

# The exit codes by their old names (python/p40fleet/exit_codes.py is their home).
EXIT_OK = Exit.OK
EXIT_ERROR = Exit.ERROR
EXIT_HOSTS_FAILED = Exit.HOSTS_FAILED
EXIT_HOSTS_UNREACHABLE = Exit.HOSTS_UNREACHABLE
EXIT_BAD_INPUT = Exit.BAD_INPUT
EXIT_NOT_IDEMPOTENT = Exit.NOT_IDEMPOTENT
EXIT_INTERRUPTED = Exit.INTERRUPTED

# A host's state in a run a signal stopped before its recap, neither failed nor unreachable.
INTERRUPTED = "interrupted"
STATE_PLAYBOOK = SITE_PLAYBOOK.parent / "playbooks" / "state.yml"
# site.yml's play reads these as `serial:` and `max_fail_percentage:`.
SERIAL_VAR = "p40fleet_serial"
MAX_FAIL_PERCENTAGE_VAR = "p40fleet_max_fail_percentage"


class NothingToRetry(RunError):
    """--retry-failed without a previous run to take the hosts from."""


@dataclass(frozen=True)
class HostStats:
    ok: int = 0
    changed: int = 0
    failures: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass
class HostResult:
    host: str
    state: str  # ok | changed | failed | unreachable | interrupted
    stats: HostStats
    failures: list[HostFailure] = field(default_factory=list)

    @property
    def first_failure(self) -> HostFailure | None:
        return self.failures[0] if self.failures else None


@dataclass
class ProvisionResult:
    inventory: Path
    playbook: Path
    exit_code: int
    status: str  # ansible-runner's status, or "bad-input" / "nothing-to-retry" when nothing ran
    rc: int | None = None  # ansible-playbook's own exit code; None when nothing ran
    run_id: str | None = None
    limit: str | None = None  # as the run was limited (--retry-failed computes it)
    tags: str | None = None
    check: bool = False
    started: str = ""
    finished: str = ""
    hosts: dict[str, HostResult] = field(default_factory=dict)
    failures: list[HostFailure] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # bad input, found before any host was touched
    message: str = ""
    artifact_dir: Path | None = None
    run: RunResult | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    def hosts_in(self, *states: str) -> list[str]:
        return sorted(h for h, r in self.hosts.items() if r.state in states)


def host_state(stats: Mapping[str, int]) -> str:
    if stats.get("unreachable"):
        return "unreachable"
    if stats.get("failures"):
        return "failed"
    return "changed" if stats.get("changed") else "ok"


def exit_code_for(result) -> int:
    """From a RunResult (or anything with .stats and .rc): a signal that stopped the run over failed over
    unreachable over ok."""
    if getattr(result, "signal", None):
        return for_signal(result.signal)
    if any(stats["failures"] for stats in result.stats.values()):
        return EXIT_HOSTS_FAILED
    if any(stats["unreachable"] for stats in result.stats.values()):
        return EXIT_HOSTS_UNREACHABLE
    if result.rc != 0:
        return EXIT_HOSTS_FAILED
    return EXIT_OK


def _extra(extra_vars: Mapping | Sequence[str] | ExtraVars | None) -> ExtraVars:
    if extra_vars is None:
        return ExtraVars()
    if isinstance(extra_vars, ExtraVars):
        return extra_vars
    if isinstance(extra_vars, Mapping):
        extra = ExtraVars()
        extra.add(extra_vars)
        return extra
    if isinstance(extra_vars, str):
        return parse_extra_vars([extra_vars])
    return parse_extra_vars(list(extra_vars))


def _serial_value(serial: int | str | Sequence | None):
    """ansible's `serial:` takes a number, a percentage or a list of them (batches growing)."""
    if serial is None or isinstance(serial, int):
        return serial
    if isinstance(serial, str):
        parts = [p.strip() for p in serial.split(",") if p.strip()]
    else:
        parts = [str(p).strip() for p in serial]
    values = []
    for part in parts:
        number = part[:-1] if part.endswith("%") else part
        if not number.isdigit() or int(number) < 1 or (part.endswith("%") and int(number) > 100):
            raise ValueError(f"--serial {serial}: {part!r} is neither a host count nor a percentage like 25%")
        values.append(part if part.endswith("%") else int(part))
    if not values:
        raise ValueError(f"--serial {serial!r}: give a host count, a percentage, or a comma-separated list")
    return values[0] if len(values) == 1 else values


def last_run_failed_hosts(state: StateDir, inventory: Path) -> tuple[list[str], dict]:
    """The hosts that failed, were unreachable or were interrupted in the last run against the inventory."""
    last = state.inventory(inventory).read_last_report()
    if not last or not last.get("runs"):
        raise NothingToRetry(
            f"--retry-failed: no previous run against {inventory} in {state.root}: run without --retry-failed first"
        )
    run = last["runs"][-1]
    hosts = sorted(
        h for h, e in run.get("hosts", {}).items() if e.get("state") in ("failed", "unreachable", INTERRUPTED)
    )
    return hosts, run


def _host_results(run: RunResult, targeted: Iterable[str] = ()) -> dict[str, HostResult]:
    """Each host's result. A run a signal stopped before its recap: a host that failed or was unreachable keeps
    that, the others (and the targeted hosts no result came from) are interrupted, with the counts until then."""
    stats = dict(run.stats)
    stopped = bool(run.signal) and not run.recap
    if stopped:
        stats.update({host: dict(vars(HostStats())) for host in targeted if host not in stats})
    results = {}
    for host, counts in sorted(stats.items()):
        state = host_state(counts)
        if stopped and state not in ("failed", "unreachable"):
            state = INTERRUPTED
        results[host] = HostResult(host, state, HostStats(**counts), run.host_failures(host))
    return results


def provision(
    inventory: Path | str,
    *,
    playbook: Path | str | None = None,
    limit: str | None = None,
    tags: str | None = None,
    skip_tags: str | None = None,
    extra_vars: Mapping | Sequence[str] | ExtraVars | None = None,
    check: bool = False,
    diff: bool | None = None,
    forks: int | None = None,
    serial: int | str | Sequence | None = None,
    max_fail_percentage: int | None = None,
    become_password_file: Path | str | None = None,
    retry_failed: bool = False,
    state_dir: Path | str | StateDir | None = None,
    keep_runs: int | None = None,
    pass_env: Iterable[str] = (),
    progress: Callable[[dict], None] | None = None,
    label: str = "run",
    record: bool = True,
) -> ProvisionResult:
    """Provision the inventory's hosts (site.yml unless `playbook` says otherwise).

    Bad input (an inventory Ansible cannot parse, a limit that matches nothing, a role variable
    whose value its argument spec refuses) is found before any host is touched: the result then has
    exit_code EXIT_BAD_INPUT and `problems`. Raises RunError when p40fleet cannot run at all (no
    ansible, another run holds the inventory: RunLocked, --retry-failed with no previous run:
    NothingToRetry). `record` keeps the run as the inventory's last (what --retry-failed and
    `p40fleet report` read)."""
    inventory = Path(inventory).expanduser().resolve()
    if not inventory.exists():
        raise RunError(f"inventory {inventory} not found: copy inventory/hosts.example.yml and edit it")
    playbook = Path(playbook).expanduser().resolve() if playbook else SITE_PLAYBOOK
    if not playbook.is_file():
        raise RunError(f"playbook {playbook} not found")
    state = state_dir if isinstance(state_dir, StateDir) else StateDir(state_dir)
    inventory_state = state.inventory(inventory).ensure()
    base = {"inventory": inventory, "playbook": playbook, "tags": tags, "check": check}

    with inventory_lock(inventory_state.lock_path, inventory):
        started = now()
        extra = _extra(extra_vars)
        problems = list(extra.problems)
        generated: dict = {}
        try:
            if serial is not None:
                generated[SERIAL_VAR] = _serial_value(serial)
        except ValueError as error:
            problems.append(str(error))
        if max_fail_percentage is not None:
            if isinstance(max_fail_percentage, bool) or not 0 <= int(max_fail_percentage) <= 100:
                problems.append(f"--max-fail-percentage {max_fail_percentage}: expected 0 to 100")
            else:
                generated[MAX_FAIL_PERCENTAGE_VAR] = int(max_fail_percentage)
        if forks is not None and int(forks) < 1:
            problems.append(f"--forks {forks}: expected at least 1")

        env = ansible_env(inventory, pass_env=pass_env)
        if retry_failed:
            failed, last = last_run_failed_hosts(state, inventory)
            if failed and limit:
                try:
                    listings = inventory_state.listings_dir
                    listed = load_inventory(inventory, env, limit, playbook_dir=playbook.parent, cache_dir=listings)
                    wanted = set(listed.hosts)
                except InventoryError as error:
                    wanted, problems = set(), [*problems, str(error)]
                failed = [h for h in failed if h in wanted]
            if not failed and not problems:
                why = f"the last run ({last.get('run_id', '?')}, {last.get('finished', '?')}) "
                if limit:
                    why += f"had no failed or unreachable host that --limit {limit} matches: nothing to retry"
                elif last.get("rc") not in (0, None) and not last.get("hosts"):
                    why += f"failed with no host to blame (rc {last.get('rc')}): run again without --retry-failed"
                else:
                    why += "had no failed or unreachable host: nothing to retry"
                return ProvisionResult(**base, exit_code=EXIT_OK, status="nothing-to-retry", message=why)
            limit = ",".join(failed)

        checked = check_inputs(
            inventory, env, playbook, limit=limit, extra=extra, cache_dir=inventory_state.listings_dir
        )
        problems += checked.problems
        if problems:
            return ProvisionResult(
                **base, limit=limit, exit_code=EXIT_BAD_INPUT, status="bad-input", problems=problems, started=started
            )

        cmdline: list[str] = []
        if limit:
            cmdline += ["--limit", limit]
        if tags:
            cmdline += ["--tags", tags]
        if skip_tags:
            cmdline += ["--skip-tags", skip_tags]
        if check:
            cmdline.append("--check")
        if diff if diff is not None else check:
            cmdline.append("--diff")
        if forks is not None:
            cmdline += ["--forks", str(int(forks))]
        run = run_playbook(
            playbook,
            inventory,
            cmdline=cmdline,
            extravars=[*typed(extra), generated] if generated else typed(extra),
            progress=progress,
            become_password_file=become_password_file,
            state_dir=state,
            keep_runs=keep_runs,
            pass_env=pass_env,
        )
        result = _result_of(run, **base, limit=limit, run=run, targeted=checked.hosts)
        if record:
            from p40fleet.report import build_report

            report = build_report([(label, result)])
            inventory_state.write_last_report(report)
            hosts_state = fleet.update_hosts(inventory_state.read_hosts(), report["runs"][0], run.events)
            inventory_state.write_hosts(hosts_state)
        return result


def _result_of(finished_run: RunResult, targeted: Iterable[str] = (), **fields) -> ProvisionResult:
    """What a finished run says, as the typed result (fields: what the caller knows besides the run; targeted: the
    hosts it ran on)."""
    run = finished_run
    return ProvisionResult(
        **fields,
        exit_code=exit_code_for(run),
        status=run.status,
        rc=run.rc,
        run_id=run.run_id,
        started=run.started,
        finished=run.finished,
        hosts=_host_results(run, targeted),
        failures=list(run.failures),
        artifact_dir=run.artifact_dir,
    )


@dataclass
class RefreshResult:
    exit_code: int
    run: RunResult
    probed: list[str]
    missing: list[str]


def refresh_state(
    inventory: Path | str,
    *,
    limit: str | None = None,
    state_dir: Path | str | StateDir | None = None,
    become_password_file: Path | str | None = None,
    playbook: Path | str | None = None,
    progress: Callable[[dict], None] | None = None,
) -> RefreshResult:
    """Run playbooks/state.yml (read-only: only the fleet_state probe) and keep each host's result."""
    inventory = Path(inventory).expanduser().resolve()
    playbook = Path(playbook).resolve() if playbook else STATE_PLAYBOOK
    if not playbook.is_file():
        raise RunError(f"{playbook} not found: this checkout has no state probe playbook")
    state = state_dir if isinstance(state_dir, StateDir) else StateDir(state_dir)
    inventory_state = state.inventory(inventory).ensure()
    with inventory_lock(inventory_state.lock_path, inventory):
        run = run_playbook(
            playbook,
            inventory,
            cmdline=["--limit", limit] if limit else [],
            progress=progress,
            become_password_file=become_password_file,
            state_dir=state,
        )
        from p40fleet.report import build_report

        summary = _result_of(run, inventory=inventory, playbook=playbook)
        entry = build_report([("state refresh", summary)])["runs"][0]
        hosts_state = fleet.update_hosts(inventory_state.read_hosts(), entry, run.events, provisioning=False)
        inventory_state.write_hosts(hosts_state)
    probed = sorted(fleet.probe_results(run.events))
    missing = sorted(set(run.stats) - set(probed))
    return RefreshResult(exit_code=summary.exit_code, run=run, probed=probed, missing=missing)
