"""Benchmark: how much a converged (no-op) run of site.yml costs next to a facts+ping play.

Prints figures; asserts nothing about speed (machines differ). Run with `make bench`.
"""

from __future__ import annotations

import argparse
import statistics
import time

from p40fleet.paths import REPO_ROOT, SITE_PLAYBOOK
from p40fleet.run import run_playbook
from p40fleet.sandbox import Sandbox

FACTS_PING = REPO_ROOT / "python" / "tests" / "playbooks" / "facts_ping.yml"


def timed(playbook, inventory, rounds: int) -> tuple[list[float], object]:
    seconds, result = [], None
    for _ in range(rounds):
        start = time.monotonic()
        result = run_playbook(playbook, inventory)
        seconds.append(time.monotonic() - start)
        if result.rc != 0:
            raise SystemExit(f"{playbook.name} failed (rc {result.rc}):\n{result.stdout[-3000:]}")
    return seconds, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()

    sandbox = Sandbox("bench")
    sandbox.up(["p40"] * args.hosts)
    try:
        converge_start = time.monotonic()
        first = run_playbook(SITE_PLAYBOOK, sandbox.inventory_dir)
        converge_seconds = time.monotonic() - converge_start
        if first.rc != 0:
            raise SystemExit(f"converge failed (rc {first.rc}):\n{first.stdout[-3000:]}")
        floor, _ = timed(FACTS_PING, sandbox.inventory_dir, args.rounds)
        noop, result = timed(SITE_PLAYBOOK, sandbox.inventory_dir, args.rounds)
        tasks = {h: s["ok"] + s["skipped"] for h, s in result.stats.items()}
        changed = sum(s["changed"] for s in result.stats.values())
        print(f"hosts                         {args.hosts}")
        print(f"first converge                {converge_seconds:7.1f} s")
        print(f"facts+ping play (median)      {statistics.median(floor):7.1f} s   {floor}")
        print(f"converged site.yml (median)   {statistics.median(noop):7.1f} s   {noop}")
        print(f"ratio converged / facts+ping  {statistics.median(noop) / statistics.median(floor):7.1f} x")
        print(f"task results per host         {sorted(set(tasks.values()))}")
        print(f"changed on the converged run  {changed}")
    finally:
        if not args.keep:
            sandbox.down()


if __name__ == "__main__":
    main()
