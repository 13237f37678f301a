"""The p40fleet command: provision a fleet and report in a form scripts can trust.

Its exit codes are python/p40fleet/exit_codes.py's, shown in docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from p40fleet import fleet
from p40fleet import report as report_mod
from p40fleet.api import (
    EXIT_BAD_INPUT,
    EXIT_ERROR,
    EXIT_HOSTS_FAILED,
    EXIT_HOSTS_UNREACHABLE,
    EXIT_INTERRUPTED,
    EXIT_NOT_IDEMPOTENT,
    EXIT_OK,
    exit_code_for,
    provision,
    refresh_state,
)
from p40fleet.inputs import InventoryError, load_inventory
from p40fleet.lock import RunLocked
from p40fleet.output import StderrConsole
from p40fleet.paths import ANSIBLE_DIR
from p40fleet.progress import make_progress, one_line, printable
from p40fleet.run import RunError, ansible_env
from p40fleet.run_time import run_time
from p40fleet.state import StateDir

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_ERROR",
    "EXIT_HOSTS_FAILED",
    "EXIT_HOSTS_UNREACHABLE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_IDEMPOTENT",
    "EXIT_OK",
    "exit_code_for",
    "main",
]

# rich's console on standard error, imported only where a line needs more than plain text (python/p40fleet/output.py).
console = StderrConsole()


def _provision(args: argparse.Namespace, inventory: Path, label: str):
    with make_progress(console, label) as progress:
        return provision(
            inventory,
            playbook=getattr(args, "playbook", None),
            limit=getattr(args, "limit", None),
            tags=getattr(args, "tags", None),
            extra_vars=getattr(args, "extra_vars", None) or (),
            check=getattr(args, "check", False),
            forks=getattr(args, "forks", None),
            serial=getattr(args, "serial", None),
            max_fail_percentage=getattr(args, "max_fail_percentage", None),
            become_password_file=getattr(args, "become_password_file", None),
            retry_failed=getattr(args, "retry_failed", False),
            state_dir=getattr(args, "state_dir", None),
            keep_runs=getattr(args, "keep_runs", None),
            pass_env=getattr(args, "pass_env", None) or (),
            progress=progress,
            label=label,
        )


def _say_why_nothing_ran(result) -> None:
    if result.problems:
        console.out(
            f"p40fleet: bad input, nothing was run and no host was contacted ({len(result.problems)} problem(s)):",
            highlight=False,
        )
        for problem in result.problems:
            console.out(f"  - {problem}", highlight=False)
    elif result.message:
        console.out(f"p40fleet: {result.message}", highlight=False)


def _run_reported(args: argparse.Namespace, label: str, prepare=None, done=None) -> int:
    """One playbook run with its summary and report: `prepare(args, inventory)` first (where given), what
    `done(result)` says after a run that happened."""
    inventory = Path(args.inventory)
    if not inventory.exists():
        console.out(f"p40fleet: inventory {inventory} not found: copy inventory/hosts.example.yml and edit it")
        return EXIT_ERROR
    if prepare is not None:
        prepare(args, inventory)
    result = _provision(args, inventory, label)
    summary = report_mod.build_report([(label, result)])
    if result.run_id is None:
        _say_why_nothing_ran(result)
    else:
        report_mod.print_summary(console, summary)
        if done is not None:
            console.out(f"p40fleet: {done(result)}", highlight=False)
    report_mod.write_report(summary, args.report)
    return result.exit_code


def _add_extra_vars(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-e",
        "--extra-vars",
        action="append",
        metavar="VARS",
        help="variables as ansible-playbook takes them: key=value, JSON/YAML, or @FILE (repeatable);"
        " checked against the roles' argument specs before any host is touched, and handed to"
        " ansible-playbook as a file, so no value reaches the runner's artifacts",
    )


def cmd_run(args: argparse.Namespace) -> int:
    return _run_reported(args, "run", _with_qualify_history)


QUALIFY_PLAYBOOK = ANSIBLE_DIR / "playbooks" / "qualify.yml"
QUALIFY_HISTORY = "gpu-qualify.json"


def qualify_history_path(state_dir: Path | str | None, inventory: Path) -> Path:
    """Where the controller keeps every card's verdicts (roles/gpu_qualify): in the inventory's state directory."""
    return StateDir(state_dir).inventory(inventory).dir / QUALIFY_HISTORY


def _with_qualify_history(args: argparse.Namespace, inventory: Path) -> None:
    """Every run reads the same history: qualify writes it, the smoke and the cluster plan refuse failed cards."""
    history = qualify_history_path(getattr(args, "state_dir", None), inventory)
    history.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # The history's place comes first, so an -e of the operator's own still wins. Under both names: gpu_qualify's
    # copy follows the shared one, but an inventory's copy would otherwise outrank the shared -e.
    places = {"p40fleet_qualify_history_file": str(history), "gpu_qualify_history_file": str(history)}
    args.extra_vars = [json.dumps(places), *(args.extra_vars or [])]


def _prepare_qualify(args: argparse.Namespace, inventory: Path) -> None:
    _with_qualify_history(args, inventory)
    args.playbook = QUALIFY_PLAYBOOK


def _file_version(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_mtime_ns, stat.st_size


def qualify_outcome(history: Path, before: tuple[int, int] | None, result) -> str:
    """What the run did to the verdicts' file: said only when it was written (the role writes it whatever happened
    on the hosts that ran; none may have)."""
    if _file_version(history) != before:
        return f"this run's verdicts and host failures are kept in {history}"
    return (
        f"no verdict was written to {history}: no host reached the judging"
        + (f" ({result.status})" if result.status else "")
        + "; the failures above say why"
    )


def cmd_qualify(args: argparse.Namespace) -> int:
    history = qualify_history_path(getattr(args, "state_dir", None), Path(args.inventory))
    before = _file_version(history)
    return _run_reported(args, "qualify", _prepare_qualify, lambda result: qualify_outcome(history, before, result))


def _record_line(record: fleet.HostRecord) -> str:
    parts = [f"{record.host}: {record.status}"]
    if record.gpu:
        said = (record.gpu_memory_mib and f"{record.gpu_memory_mib} MiB", record.ecc and f"ECC {record.ecc}")
        memory = ", ".join(v for v in said if v)
        parts.append(record.gpu + (f" ({memory})" if memory else ""))
    if record.driver:
        about = ", ".join(
            v for v in (record.kernel_module and f"{record.kernel_module} module", record.driver_hold) if v
        )
        parts.append(f"driver {record.driver}" + (f" ({about})" if about else ""))
    if record.profile:
        parts.append(f"profile {record.profile}")
    for label, value in (
        ("CUDA", record.cuda),
        ("cuDNN", record.cudnn),
        ("torch", record.torch),
        ("Apex", record.apex and record.apex + (f" (built by {record.apex_built_by})" if record.apex_built_by else "")),
        ("verl", record.verl),
        ("patch set", record.patch_set),
        ("launch script", record.launch_script),
        ("smoke run", (record.smoke or {}).get("summary")),
        ("run time", run_time(record.smoke)),
    ):
        if value:
            parts.append(f"{label} {value}")
    if record.drift:
        parts.append("drift: " + "; ".join(f"{stage}: {', '.join(r)}" for stage, r in record.drift.items()))
    if record.last_run:
        parts.append(f"last run {record.last_run.state} at {record.last_run.finished} ({record.last_run.run_id})")
    # Parts of it are owner-made (the smoke summary, Apex's builder): no control characters reach the terminal.
    return printable(" · ".join(parts))


def print_records(records: list[fleet.HostRecord], totals: dict) -> None:
    head = f"p40fleet report: {totals['hosts']} host(s): " + ", ".join(
        f"{n} {status}" for status, n in totals.items() if status != "hosts" and n
    )
    if console.is_terminal:
        from rich.markup import escape
        from rich.table import Table

        table = Table(title=escape(head))
        for column in ("host", "status", "GPU", "driver", "profile", "CUDA", "torch", "verl", "patch set", "last run"):
            table.add_column(column, overflow="fold")
        for r in records:
            last = f"{r.last_run.state} {r.last_run.finished}" if r.last_run else ""
            cells = (r.host, r.status, r.gpu, r.driver, r.profile, r.cuda, r.torch, r.verl, r.patch_set, last)
            table.add_row(*(escape(str(c)) if c else "-" for c in cells))
        console.print(table)
    else:
        console.out(head, highlight=False)
        for record in records:
            console.out(f"  {_record_line(record)}", highlight=False)
    for record in records:
        if record.first_failure:
            failure = record.first_failure
            console.out(f"{record.host}: first failure: {failure.task}: {one_line(failure.message)}", highlight=False)


def cmd_report(args: argparse.Namespace) -> int:
    # Only the report reads these; `p40fleet run` starts without them (docs/benchmarks-overhead.md).
    from p40fleet import card_table, html_report
    from p40fleet import train as train_mod
    from p40fleet.train import saved_runs

    inventory = Path(args.inventory)
    if not inventory.exists():
        console.out(f"p40fleet: inventory {inventory} not found")
        return EXIT_ERROR
    inventory = inventory.resolve()
    state = StateDir(args.state_dir)
    code = EXIT_OK
    if args.refresh:
        with make_progress(console, "state refresh") as progress:
            refreshed = refresh_state(
                inventory,
                limit=args.limit,
                state_dir=state,
                become_password_file=args.become_password_file,
                progress=progress,
            )
        code = refreshed.exit_code
        if refreshed.missing:
            console.out(f"p40fleet: no state probe result from {', '.join(refreshed.missing)}", highlight=False)
    try:
        names = load_inventory(inventory, ansible_env(inventory)).hosts
    except InventoryError as error:
        console.out(f"p40fleet: {error}", highlight=False)
        return EXIT_BAD_INPUT
    saved = state.inventory(inventory).read_hosts()
    saved["hosts"] = {h: v for h, v in saved.get("hosts", {}).items() if h in names}
    records = fleet.host_records(saved, hosts=names)
    data = fleet.fleet_report(records, str(inventory))
    data["cards"] = card_table.card_rows(card_table.read_history(qualify_history_path(state.root, inventory)), names)
    # The training runs' last status, as `p40fleet train` saw it (python/p40fleet/train.py).
    data["runs"] = saved_runs(state, inventory)
    if args.json:
        report_mod.write_report(data, args.json)
    if args.html:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(html_report.render_html(data), encoding="utf-8")
    print_records(records, data["totals"])
    # What the HTML shows besides the hosts: every card's last qualification and the training runs.
    for line in card_table.card_lines(data["cards"]):
        console.out(line, highlight=False)
    if data["runs"]:
        console.out("Training runs (their last status, as `p40fleet train` saw it):", highlight=False)
        train_mod.print_runs(console, data["runs"])
    for path in (args.json, args.html):
        if path:
            print(path)
    return code


def cmd_cluster(args: argparse.Namespace) -> int:
    from rich.console import Console

    from p40fleet import cluster

    inventory = Path(args.inventory)
    if not inventory.exists():
        console.out(f"p40fleet: inventory {inventory} not found")
        return EXIT_ERROR
    try:
        run, clusters = cluster.cluster_status(inventory, become_password_file=args.become_password_file)
    except RunError as error:
        console.out(f"p40fleet: {error}", highlight=False)
        return EXIT_ERROR
    cluster.print_status(Console(highlight=False), clusters)
    if args.json:
        cluster.write_json(clusters, args.json)
    if run.rc != 0:
        return exit_code_for(run)
    complete = all(
        m["alive"] and not m.get("mismatch") and not m.get("firewall") for c in clusters.values() for m in c["members"]
    )
    return EXIT_OK if complete and not any(c.get("error") for c in clusters.values()) else EXIT_HOSTS_FAILED


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from p40fleet import train

    inventory = Path(args.inventory)
    if not inventory.exists():
        console.out(f"p40fleet: inventory {inventory} not found")
        return EXIT_ERROR
    problems = train.refusals(inventory, args.limit)
    if problems:
        for problem in problems:
            console.out(f"p40fleet train: {problem}", highlight=False)
        return EXIT_BAD_INPUT
    extra = {"train_run_name": args.name} if args.name else {}
    if args.cluster:
        extra["train_run_cluster"] = args.cluster
    result = train.train(
        inventory,
        args.train_command,
        limit=args.limit,
        extra_vars=extra,
        become_password_file=args.become_password_file,
        state_dir=args.state_dir,
    )
    # With `--json -` the JSON is standard output's alone; the table goes to standard error.
    to_stdout = args.json is not None and str(args.json) == "-"
    train.print_runs(Console(highlight=False, stderr=to_stdout), result.runs, wide=args.wide)
    for failure in result.run.failures:
        console.out(f"{failure.host}: {failure.task}: {one_line(failure.message)}", highlight=False)
    if args.json:
        train.write_json(result.runs, args.json)
    if result.run.rc != 0:
        return exit_code_for(result.run)
    troubled = args.train_command == "status" and any(r.get("state") in train.TROUBLE for r in result.runs)
    return EXIT_HOSTS_FAILED if troubled else EXIT_OK


def cmd_fetch(args: argparse.Namespace) -> int:
    from p40fleet.fetch import FetchError, fill_controller_cache

    try:
        outcomes = fill_controller_cache(args.inventory, args.limit)
    except FetchError as error:
        console.print(f"[red]p40fleet fetch: {error}[/]")
        return EXIT_ERROR
    kept = sum(1 for outcome in outcomes if outcome.state == "present")
    console.print(f"Controller cache: {len(outcomes) - kept} downloaded, {kept} already there and valid.")
    return EXIT_OK


def cmd_bundle(args: argparse.Namespace) -> int:
    from p40fleet.bundle import make_bundle
    from p40fleet.fetch import FetchError

    try:
        result = make_bundle(args.dir, args.inventory, args.limit)
    except FetchError as error:
        console.print(f"[red]p40fleet bundle: {error}[/]")
        return EXIT_ERROR
    kept = sum(1 for outcome in result.outcomes if outcome.state == "present")
    console.print(
        f"Bundle {result.out_dir}: {len(result.outcomes)} files ({len(result.outcomes) - kept} downloaded),"
        f" repositories {', '.join(result.repositories) or 'none'}; checksums in SHA256SUMS."
    )
    for note in result.notes:
        console.print(f"[yellow]Note:[/] {note}")
    console.print(
        "Serve the directory as is over HTTP(S) and point the fleet at it (group_vars):\n"
        "  artifact_fetch_source: mirror\n"
        "  p40fleet_mirror_base_url: <the URL the directory is served at>\n"
        "  pytorch_source: mirror\n"
        "  apex_git_source: mirror\n"
        "  verl_git_source: mirror"
    )
    return EXIT_OK


INVENTORY_HELP = "the fleet's Ansible inventory (default %(default)s)"
LIMIT_HELP = "only these hosts: a host, a group or a pattern, as ansible-playbook's --limit takes it"
BECOME_PASSWORD_HELP = (
    "file holding the sudo password (first line); passed to ansible-playbook as --become-password-file,"
    " so the password itself reaches no runner artifact or log"
)


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors exit EXIT_ERROR: its own 2 is EXIT_HOSTS_FAILED here. Subcommands'
    parsers are of the same class (add_subparsers' default)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def parser() -> argparse.ArgumentParser:
    top = Parser(prog="p40fleet", description=__doc__.split("\n", 1)[0])
    sub = top.add_subparsers(dest="command", required=True)

    state = argparse.ArgumentParser(add_help=False)
    state.add_argument(
        "--state-dir",
        type=Path,
        help="where runs, the last report and the hosts' state are kept (default $P40FLEET_STATE_DIR,"
        " else $XDG_STATE_HOME/p40fleet, else ~/.local/state/p40fleet)",
    )
    state.add_argument(
        "--keep-runs",
        type=int,
        help="how many runs (ansible-runner private dirs with their artifacts) to keep per inventory"
        " (default $P40FLEET_KEEP_RUNS, else 10)",
    )

    run = sub.add_parser("run", parents=[state], help="run site.yml against an inventory")
    run.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    run.add_argument("--playbook", type=Path, help="another playbook than site.yml (e.g. playbooks/verify.yml)")
    run.add_argument("-l", "--limit", help=LIMIT_HELP)
    run.add_argument("-t", "--tags", help="only the tasks with these tags (ansible-playbook's --tags)")
    _add_extra_vars(run)
    run.add_argument("--check", action="store_true", help="dry run: --check --diff")
    run.add_argument("--forks", type=int, help="hosts worked on in parallel (ansible's --forks; ansible.cfg: 20)")
    run.add_argument(
        "--serial",
        help="hosts per batch, as a count, a percentage (25%%) or a list (1,10%%,50%%): the play keyword serial,"
        " a batch goes through the play before the next one starts",
    )
    run.add_argument(
        "--max-fail-percentage",
        type=int,
        help="stop the run when more than this percentage of a batch's hosts failed (play keyword max_fail_percentage)",
    )
    run.add_argument(
        "--retry-failed",
        action="store_true",
        help="only the hosts that failed or were unreachable in the last run against this inventory"
        " (within --limit, if given)",
    )
    run.add_argument(
        "--pass-env",
        action="append",
        metavar="NAME",
        help="pass this environment variable to ansible-playbook too (repeatable); only what Ansible and SSH"
        " need is passed otherwise, and the value is redacted in the runner's artifacts",
    )
    run.add_argument("--report", type=Path, help="write the machine-readable report (JSON) here")
    run.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    run.set_defaults(func=cmd_run)

    qualify = sub.add_parser(
        "qualify",
        parents=[state],
        help="qualify every GPU under load (playbooks/qualify.yml): a pass/warn/fail verdict per card, kept per serial",
    )
    qualify.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    qualify.add_argument("-l", "--limit", help=LIMIT_HELP)
    _add_extra_vars(qualify)
    qualify.add_argument("--report", type=Path, help="write the machine-readable report (JSON) here")
    qualify.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    qualify.set_defaults(func=cmd_qualify)

    report = sub.add_parser(
        "report", parents=[state], help="what each host now is: GPU, driver, profile, versions, last run"
    )
    report.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    report.add_argument("--json", type=Path, help="write the fleet report as JSON here")
    report.add_argument("--html", type=Path, help="write the fleet report as one static HTML page here")
    report.add_argument(
        "--refresh",
        action="store_true",
        help="read every host's state first (playbooks/state.yml: the read-only state probe, nothing changed)",
    )
    report.add_argument("-l", "--limit", help="with --refresh: probe only these hosts")
    report.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    report.set_defaults(func=cmd_report)

    cluster = sub.add_parser("cluster", help="Ray clusters across hosts (playbooks/cluster.yml forms them)")
    csub = cluster.add_subparsers(dest="cluster_command", required=True)
    cstatus = csub.add_parser("status", help="members, GPUs, alive or not, the last job and its state (read-only)")
    cstatus.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    cstatus.add_argument("--json", type=Path, help="write the status as JSON here (schema p40fleet.cluster-status/v1)")
    cstatus.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    cluster.set_defaults(func=cmd_cluster)

    train = sub.add_parser("train", help="training runs on the fleet: start (or resume), stop, status")
    tsub = train.add_subparsers(dest="train_command", required=True)
    for action, text in (
        ("start", "start each host's run (train_run_overrides per host) or a cluster's job; resumes a stopped one"),
        ("stop", "stop the runs (their last checkpoint stays for `start`)"),
        ("status", "each run's step, s/step, scores, checkpoint, expected end; a reboot under a run (read-only)"),
    ):
        taction = tsub.add_parser(action, help=text)
        taction.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
        taction.add_argument("-l", "--limit", help=LIMIT_HELP)
        taction.add_argument("--name", help="the run's name (train_run_name, default gsm8k)")
        taction.add_argument("--cluster", help="one job on this Ray cluster (p40fleet_cluster) instead of a run a host")
        taction.add_argument(
            "--json",
            type=Path,
            metavar="FILE",
            help="write the runs as JSON here, - for standard output (schema p40fleet.train-runs/v1)",
        )
        taction.add_argument(
            "--wide",
            action="store_true",
            help="on a terminal, the table with each run's start and log too (elsewhere every run is one whole line)",
        )
        taction.add_argument("--state-dir", type=Path, help="where the runs' last status is kept for the report")
        taction.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    train.set_defaults(func=cmd_train)

    fetch = sub.add_parser("fetch", help="download every pinned artifact into the controller cache (verified)")
    fetch.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    fetch.add_argument("-l", "--limit", help=LIMIT_HELP)
    fetch.set_defaults(func=cmd_fetch)

    bundle = sub.add_parser("bundle", help="write one directory a fleet mirror serves as is (air-gapped fleets)")
    bundle.add_argument("dir", type=Path, help="the bundle directory (created; what is there and valid is kept)")
    bundle.add_argument("-i", "--inventory", default="inventory/hosts.yml", help=INVENTORY_HELP)
    bundle.add_argument("-l", "--limit", help=LIMIT_HELP)
    bundle.set_defaults(func=cmd_bundle)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (RunError, RunLocked, ValueError) as error:
        console.out(f"p40fleet: {error}", highlight=False)
        return EXIT_ERROR
    except KeyboardInterrupt:
        # Ctrl-C outside a playbook run (one in it ends the run: run.py); the shell's code for it.
        console.out("p40fleet: interrupted", highlight=False)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
