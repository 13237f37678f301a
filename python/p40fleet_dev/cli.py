"""The harness's commands, run from a checkout: `python -m p40fleet_dev sandbox|demo|fixtures ...`.

The sandbox fleet, the demo on it and the test fixtures are development tools (the operator's command,
`p40fleet`, carries none of them). Exit codes are p40fleet's (p40fleet.cli); `demo` adds 5: the second
run reported changes (the playbook is not idempotent).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from p40fleet import report as report_mod
from p40fleet.api import EXIT_ERROR, EXIT_NOT_IDEMPOTENT, EXIT_OK
from p40fleet.cli import BECOME_PASSWORD_HELP, _provision, console
from p40fleet.lock import RunLocked
from p40fleet.run import RunError
from p40fleet_dev import standins
from p40fleet_dev.fixtures import FixtureError, fetch_upstream
from p40fleet_dev.sandbox import (
    DEFAULT_LOGIN,
    DEFAULT_OS,
    LOGIN_MODES,
    OS_RELEASES,
    Sandbox,
    SandboxError,
    gpu_profiles,
)

DEMO_PROFILES = ("p40", "p40-old-smi", "p40x2")
# `sandbox up` starts its hosts from this podman image where set (a converged host, p40fleet_dev.images): the docs
# test's seam, so the recipe's `p40fleet run` is a converged re-run there instead of minutes of a fresh converge.
IMAGE_ENV = "P40FLEET_SANDBOX_IMAGE"

LOGIN_HELP = (
    "how Ansible logs in: sudo (the ordinary user ops, password-less sudo), sudo-password (ops, sudo asks"
    f" for a password made per sandbox) or root (default {DEFAULT_LOGIN})"
)


# What `sandbox up --services` says it installed: stand-ins, each named as one (p40fleet_dev/standins.py).
STANDINS_NOTE = (
    "Stand-ins on every host (test fixtures, not the real programs; docs/dev/sandbox.md):\n"
    "  systemctl    a stand-in service manager for train's units (python/tests/fixtures/standins/host/systemd/)\n"
    "  trainer      a stand-in for verl's trainer, no GPU (train_run_command; .../standins/trainer/verl_standin.py)\n"
    "  qualify      a stand-in nvidia-smi answering as recorded card {card} (.../standins/gpu_qualify/),\n"
    "               a load that only sleeps (gpu_qualify_load_command)\n"
    "  env owner    the account {owner}, made as conda_env makes it"
)


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
        # The tests' seam (docs/dev/sandbox-day.md): hosts started as copies of a converged host's image.
        image = os.environ.get(IMAGE_ENV, "")
        if image:
            console.out(f"Hosts start from the converged image {image} ({IMAGE_ENV})", highlight=False)
        hosts = sandbox.up(
            profiles,
            login=args.login,
            os_name=args.os,
            services=args.services,
            standins=args.services,
            image=image,
            owner=args.owner or "",
        )
        for host in hosts:
            console.print(f"  {host.name:8} {host.address:15} {host.profile}")
        if args.services:
            owner = args.owner or standins.DEFAULT_OWNER
            console.out(STANDINS_NOTE.format(owner=owner, card=standins.DEFAULT_CARD), highlight=False)
        if args.owner:
            console.out(f"Env owner {args.owner}: p40fleet_env_owner in {sandbox.inventory_dir}", highlight=False)
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
    elif args.sandbox_command == "qualify-card":
        if not sandbox.host(args.host).standins:
            raise SandboxError(f"sandbox {args.name} was started without --services: {args.host} has no stand-in card")
        standins.give_card(sandbox, args.host, args.card, own_serial=True)
        console.print(f"{args.host}: the qualification's stand-in nvidia-smi now answers as card {args.card}")
    elif args.sandbox_command == "profiles":
        for name, spec in gpu_profiles().items():
            gpus = ", ".join(g["name"] for g in spec["gpus"]) or "no GPU"
            print(f"{name:24} driver {spec['driver_version'] or '-':12} {gpus}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    sandbox = Sandbox(args.name)
    profiles = _profiles(args.profiles) if args.profiles else list(DEMO_PROFILES)
    console.print(f"[bold]p40fleet demo[/]: sandbox {args.name} with {', '.join(profiles)}")
    sandbox.up(profiles, login=args.login, os_name=args.os)
    if args.login == "sudo-password" and args.become_password_file is None:
        args.become_password_file = sandbox.become_password_file
    first = _provision(args, sandbox.inventory_dir, "first run")
    second = _provision(args, sandbox.inventory_dir, "second run") if first.exit_code == EXIT_OK else None
    runs = [("first run", first)] + ([("second run", second)] if second else [])
    summary = report_mod.build_report(runs)
    report_mod.print_summary(console, summary)
    report_mod.write_report(summary, args.report)
    if first.exit_code != EXIT_OK:
        return first.exit_code
    if second.exit_code != EXIT_OK:
        return second.exit_code
    changed = {host: r.stats.changed for host, r in second.hosts.items() if r.stats.changed}
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


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m p40fleet_dev", description=__doc__.split("\n", 1)[0])
    sub = top.add_subparsers(dest="command", required=True)

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
    demo.add_argument("--state-dir", type=Path, help="as `p40fleet run --state-dir`")
    demo.add_argument("--keep-runs", type=int, help="as `p40fleet run --keep-runs`")
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
    up.add_argument(
        "--services",
        action="store_true",
        help="stand-ins for systemctl, verl's trainer and the qualification's nvidia-smi, and the env owner, so that"
        " `p40fleet train` and `p40fleet qualify` run on the sandbox (docs/dev/sandbox.md)",
    )
    up.add_argument(
        "--owner",
        help="the env owner (p40fleet_env_owner, written into the sandbox inventory; default the roles' p40fleet):"
        " with --services, the account the stand-ins run as",
    )
    ssub.add_parser("down", parents=[named])
    ssub.add_parser("status", parents=[named])
    ssub.add_parser("profiles", parents=[named])
    setp = ssub.add_parser("set-profile", parents=[named])
    setp.add_argument("host")
    setp.add_argument("profile")
    card = ssub.add_parser("qualify-card", parents=[named], help="with --services: the recorded card a host qualifies")
    card.add_argument("host")
    card.add_argument("card", choices=standins.card_names())
    sandbox.set_defaults(func=cmd_sandbox)

    fixtures = sub.add_parser("fixtures", help="fetch the real upstream files the tests use (PyPI)")
    fixtures.set_defaults(func=cmd_fixtures)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (SandboxError, RunError, RunLocked, FixtureError, ValueError) as error:
        console.out(f"p40fleet: {error}", highlight=False)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
