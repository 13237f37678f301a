"""The p40fleet command: provision a fleet, run the sandbox, and report in a form scripts can trust.

Exit codes (also in README.md):
  0  every host converged (and, for `demo`, the second run changed nothing)
  1  p40fleet itself could not run (bad arguments, missing inventory, podman or ansible missing)
  2  one or more hosts failed
  3  one or more hosts were unreachable, none failed
  4  `demo` only: the second run reported changes (the playbook is not idempotent)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from p40fleet import report as report_mod
from p40fleet.fixtures import FixtureError, fetch_upstream
from p40fleet.paths import SITE_PLAYBOOK
from p40fleet.run import RunError, run_playbook
from p40fleet.sandbox import DEFAULT_LOGIN, DEFAULT_OS, LOGIN_MODES, OS_RELEASES, Sandbox, SandboxError, gpu_profiles

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_HOSTS_FAILED = 2
EXIT_HOSTS_UNREACHABLE = 3
EXIT_NOT_IDEMPOTENT = 4

DEMO_PROFILES = ("p40", "p40-old-smi", "p40x2")

console = Console(stderr=True, highlight=False)


def exit_code_for(result) -> int:
    if any(stats["failures"] for stats in result.stats.values()):
        return EXIT_HOSTS_FAILED
    if any(stats["unreachable"] for stats in result.stats.values()):
        return EXIT_HOSTS_UNREACHABLE
    if result.rc != 0:
        return EXIT_HOSTS_FAILED
    return EXIT_OK


def _profiles(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def cmd_sandbox(args: argparse.Namespace) -> int:
    sandbox = Sandbox(args.name)
    if args.sandbox_command == "up":
        if args.profiles:
            profiles = _profiles(args.profiles)
        else:
            profiles = [DEMO_PROFILES[i % len(DEMO_PROFILES)] for i in range(args.hosts)]
        console.print(f"Starting sandbox [bold]{args.name}[/] with {len(profiles)} host(s): {', '.join(profiles)}")
        for host in sandbox.up(profiles, login=args.login, os_name=args.os):
            console.print(f"  {host.name:8} {host.address:15} {host.profile}")
        if args.login == "sudo-password":
            console.print(f"sudo password of ops (for --become-password-file): {sandbox.become_password_file}")
        print(sandbox.inventory_dir)
    elif args.sandbox_command == "down":
        sandbox.down()
        console.print(f"Sandbox {args.name} removed.")
    elif args.sandbox_command == "status":
        hosts = sandbox.hosts()
        if not hosts:
            console.print(f"Sandbox {args.name} is not running.")
            return EXIT_ERROR
        for host in hosts:
            console.print(f"  {host.name:8} {host.address:15} {host.profile}")
        print(sandbox.inventory_dir)
    elif args.sandbox_command == "set-profile":
        sandbox.set_profile(args.host, args.profile)
        console.print(f"{args.host}: GPU profile now {args.profile}")
    elif args.sandbox_command == "profiles":
        for name, spec in gpu_profiles().items():
            gpus = ", ".join(g["name"] for g in spec["gpus"]) or "no GPU"
            print(f"{name:24} driver {spec['driver_version'] or '-':12} {gpus}")
    return EXIT_OK


def _run_and_report(args: argparse.Namespace, inventory: Path, label: str, extra_cmdline=()):
    cmdline = list(extra_cmdline)
    if getattr(args, "limit", None):
        cmdline += ["--limit", args.limit]
    if getattr(args, "tags", None):
        cmdline += ["--tags", args.tags]
    if getattr(args, "check", False):
        cmdline += ["--check", "--diff"]
    result = run_playbook(
        playbook=getattr(args, "playbook", None) or SITE_PLAYBOOK,
        inventory=inventory,
        cmdline=cmdline,
        progress=report_mod.Progress(console, label),
        become_password_file=getattr(args, "become_password_file", None),
    )
    return result


def cmd_run(args: argparse.Namespace) -> int:
    inventory = Path(args.inventory)
    if not inventory.exists():
        console.print(f"[red]Inventory {inventory} not found.[/] Copy inventory/hosts.example.yml and edit it.")
        return EXIT_ERROR
    result = _run_and_report(args, inventory, "run")
    summary = report_mod.build_report([("run", result)])
    report_mod.print_summary(console, summary)
    report_mod.write_report(summary, args.report)
    return exit_code_for(result)


def cmd_demo(args: argparse.Namespace) -> int:
    sandbox = Sandbox(args.name)
    profiles = _profiles(args.profiles) if args.profiles else list(DEMO_PROFILES)
    console.print(f"[bold]p40fleet demo[/]: sandbox {args.name} with {', '.join(profiles)}")
    sandbox.up(profiles, login=args.login, os_name=args.os)
    if args.login == "sudo-password" and args.become_password_file is None:
        args.become_password_file = sandbox.become_password_file
    first = _run_and_report(args, sandbox.inventory_dir, "first run")
    second = _run_and_report(args, sandbox.inventory_dir, "second run") if exit_code_for(first) == 0 else None
    runs = [("first run", first)] + ([("second run", second)] if second else [])
    summary = report_mod.build_report(runs)
    report_mod.print_summary(console, summary)
    report_mod.write_report(summary, args.report)
    code = exit_code_for(first)
    if code != EXIT_OK:
        return code
    code = exit_code_for(second)
    if code != EXIT_OK:
        return code
    changed = {host: stats["changed"] for host, stats in second.stats.items() if stats["changed"]}
    if changed:
        console.print(f"[red]Second run changed something:[/] {changed}")
        return EXIT_NOT_IDEMPOTENT
    console.print("[green]Second run: changed=0 on every host.[/]")
    if not args.keep:
        sandbox.down()
    return EXIT_OK


def cmd_fixtures(args: argparse.Namespace) -> int:
    path = fetch_upstream()
    console.print(f"Upstream fixtures in {path}")
    return EXIT_OK


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
        "  artifact_fetch_mirror_base_url: <the URL the directory is served at>\n"
        "  pytorch_source: mirror\n"
        "  apex_git_source: mirror\n"
        "  verl_git_source: mirror"
    )
    return EXIT_OK


LOGIN_HELP = (
    "how Ansible logs in: sudo (the ordinary user ops, password-less sudo), sudo-password (ops, sudo asks"
    f" for a password made per sandbox) or root (default {DEFAULT_LOGIN})"
)
BECOME_PASSWORD_HELP = (
    "file holding the sudo password (first line); passed to ansible-playbook as --become-password-file,"
    " so the password itself reaches no runner artifact or log"
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="p40fleet", description=__doc__.split("\n", 1)[0])
    sub = top.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run site.yml against an inventory")
    run.add_argument("-i", "--inventory", default="inventory/hosts.yml")
    run.add_argument("--playbook", type=Path, help="another playbook than site.yml (e.g. playbooks/verify.yml)")
    run.add_argument("-l", "--limit")
    run.add_argument("-t", "--tags")
    run.add_argument("--check", action="store_true", help="dry run: --check --diff")
    run.add_argument("--report", type=Path, help="write the machine-readable report (JSON) here")
    run.add_argument("--become-password-file", type=Path, help=BECOME_PASSWORD_HELP)
    run.set_defaults(func=cmd_run)

    demo = sub.add_parser("demo", help="provision a sandbox fleet end to end, twice, and report")
    demo.add_argument("--name", default="demo")
    demo.add_argument("--profiles", help=f"comma-separated GPU profiles (default {','.join(DEMO_PROFILES)})")
    demo.add_argument("--keep", action="store_true", help="leave the sandbox running afterwards")
    demo.add_argument("--report", type=Path)
    demo.add_argument("--login", choices=LOGIN_MODES, default=DEFAULT_LOGIN, help=LOGIN_HELP)
    demo.add_argument("--os", choices=sorted(OS_RELEASES), default=DEFAULT_OS, help="the sandbox hosts' release")
    demo.add_argument(
        "--become-password-file",
        type=Path,
        help=BECOME_PASSWORD_HELP + " (default with --login sudo-password: the sandbox's own)",
    )
    demo.set_defaults(func=cmd_demo)

    sandbox = sub.add_parser("sandbox", help="simulated GPU hosts in containers, over real SSH")
    named = argparse.ArgumentParser(add_help=False)
    named.add_argument("--name", default="default", help="sandbox name (default: default)")
    ssub = sandbox.add_subparsers(dest="sandbox_command", required=True)
    up = ssub.add_parser("up", parents=[named])
    up.add_argument("--hosts", type=int, default=3)
    up.add_argument("--profiles", help="comma-separated GPU profiles, one host each (see `profiles`)")
    up.add_argument("--login", choices=LOGIN_MODES, default=DEFAULT_LOGIN, help=LOGIN_HELP)
    up.add_argument("--os", choices=sorted(OS_RELEASES), default=DEFAULT_OS, help="the hosts' release")
    ssub.add_parser("down", parents=[named])
    ssub.add_parser("status", parents=[named])
    ssub.add_parser("profiles", parents=[named])
    setp = ssub.add_parser("set-profile", parents=[named])
    setp.add_argument("host")
    setp.add_argument("profile")
    sandbox.set_defaults(func=cmd_sandbox)

    fixtures = sub.add_parser("fixtures", help="fetch the real upstream files the tests use (PyPI)")
    fixtures.set_defaults(func=cmd_fixtures)

    fetch = sub.add_parser("fetch", help="download every pinned artifact into the controller cache (verified)")
    fetch.add_argument("-i", "--inventory", default="inventory/hosts.yml")
    fetch.add_argument("-l", "--limit")
    fetch.set_defaults(func=cmd_fetch)

    bundle = sub.add_parser("bundle", help="write one directory a fleet mirror serves as is (air-gapped fleets)")
    bundle.add_argument("dir", type=Path, help="the bundle directory (created; what is there and valid is kept)")
    bundle.add_argument("-i", "--inventory", default="inventory/hosts.yml")
    bundle.add_argument("-l", "--limit")
    bundle.set_defaults(func=cmd_bundle)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (SandboxError, RunError, FixtureError) as error:
        console.print(f"[red]p40fleet: {error}[/]")
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
