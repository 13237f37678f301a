"""A real, short qualification on a CUDA machine, the way roles/gpu_qualify runs one (no Ansible, no network).

Run as root on the GPU machine, with a Python that has CUDA torch:
    python3 python/tests/gpu/qualify_check.py --seconds 60 --out OUT
It asks nvidia-smi which name its throttle reasons go by, starts nvidia-smi's sampler of the role's fields, runs
the role's load (owner_scripts/gpu_qualify_load.py, as `python -I -c <source> SECONDS`, as the role does; here as the
caller, where the role runs it as the env owner), reads `nvidia-smi -q` and the kernel log's Xid lines, and judges
every card with the role's own filter (plugins/filter/gpu_qualify.py, imported by path) and the
role's defaults. It writes OUT/qualify-<gpu>-<date>.json: the texts the filter read, its verdicts, and a digest of
what the cards did (temperatures, clocks, power, throttle reasons seen, PCIe, ECC). The record's test
(python/tests/test_gpu_qualify_record.py) judges those texts again and holds the record to its verdicts.

Loud, not silent: a field this driver refuses, samples that do not parse, a card whose report lacks what the rules
read (the reasons, the link, the temperatures), or a load that fails is printed and makes the exit non-zero (the
record is still written, with its `problems`), so a driver whose names differ from a P40's is seen, not judged on
blanks.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
ROLE = REPO / "roles" / "gpu_qualify"
SCHEMA = "p40fleet.gpu-qualify-check/v1"
XID = re.compile(r"NVRM: Xid")


def load_rules():
    spec = importlib.util.spec_from_file_location(
        "gpu_qualify_rules", ROLE.parents[1] / "plugins" / "filter" / "gpu_qualify.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def role_settings(host: str) -> dict:
    """The rules' settings from the role's defaults (stdlib only: the few lines it needs, read by pattern)."""
    text = (ROLE / "defaults" / "main.yml").read_text(encoding="utf-8")

    def scalar(name):
        match = re.search(rf"^{name}: (\d+)\s*$", text, re.MULTILINE)
        if not match:
            raise SystemExit(f"qualify_check: {name} not found as a number in {ROLE / 'defaults' / 'main.yml'}")
        return int(match.group(1))

    xid_fail = re.search(r"^gpu_qualify_xid_fail: \[([\d, ]+)\]\s*$", text, re.MULTILINE)
    block = re.search(r"^gpu_qualify_xid_meaning:\n((?:  \d+: .*\n)+)", text, re.MULTILINE)
    if not xid_fail or not block:
        raise SystemExit("qualify_check: gpu_qualify_xid_fail or gpu_qualify_xid_meaning not found in the defaults")
    meaning = dict(line.strip().split(": ", 1) for line in block.group(1).splitlines())
    return {
        "host": host,
        "max_temperature_c": scalar("gpu_qualify_max_temperature_c"),
        "load_min_utilization": scalar("gpu_qualify_load_min_utilization"),
        "min_loaded_samples": scalar("gpu_qualify_min_loaded_samples"),
        "retired_pages_max": scalar("gpu_qualify_retired_pages_max"),
        "xid_fail": [int(x) for x in xid_fail.group(1).split(",")],
        "xid_meaning": {int(k): v for k, v in meaning.items()},
    }


def run(argv, **kwargs):
    return subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)


def kernel_log() -> tuple[str, str]:
    """The kernel log since boot (journalctl as the role reads it, else dmesg), its Xid lines only."""
    for argv in (["journalctl", "--dmesg", "--boot", "--no-pager", "--output=short-monotonic"], ["dmesg"]):
        if shutil.which(argv[0]):
            done = run(argv)
            if done.returncode == 0:
                return "".join(line + "\n" for line in done.stdout.splitlines() if XID.search(line)), " ".join(argv)
    return "", ""


def card_problems(card: dict) -> list[str]:
    """What the rules read that this card's -q report did not give (a driver's other names)."""
    where = f"GPU {card['bus_id']} ({card['name'] or 'no name'})"
    missing = [
        label
        for label, value in (
            ("Product Name", card["name"]),
            ("Serial Number or GPU UUID", card["serial"] or card["uuid"]),
            ("the throttle/event reasons section", card["reasons"]),
            ("PCI/GPU Link Info/Link Width/Max", card["pcie"]["width_max"]),
            ("PCI/GPU Link Info/PCIe Generation/Max", card["pcie"]["gen_max"]),
            ("Temperature/GPU Current Temp", card["temperature"]["current"]),
            ("Max Clocks/SM", card["clocks"]["max_sm"]),
            ("Persistence Mode", card["persistence_mode"]),
            ("ECC Mode/Current", card["ecc_mode"]),
        )
        if value in (None, "", {}, [])
    ]
    return [f"{where}: nvidia-smi -q gave no {label} the rules could read" for label in missing]


def digest(verdict: dict, rows: list[dict]) -> dict:
    """What the card did under load, for people: the verdict's summary plus the temperature and clock range."""
    summary = verdict["summary"]
    temps = [r["temperature.gpu"] for r in rows if r.get("temperature.gpu") is not None]
    clocks = [r["clocks.sm"] for r in rows if r.get("clocks.sm") is not None]
    power = [r["power.draw"] for r in rows if r.get("power.draw") is not None]
    return {
        "temperature_c": {"min": min(temps, default=None), "max": max(temps, default=None)},
        "sm_clock_mhz": {
            "min": min(clocks, default=None),
            "max": max(clocks, default=None),
            "min_loaded": summary["min_sm_clock_loaded"],
            "card_max": summary["max_sm_clock"],
        },
        "power_w": {"max": max(power, default=None), "limit": summary["power_limit"]},
        "throttle_reasons_seen": summary["reasons_seen"],
        "pcie_under_load": summary["pcie_loaded"],
        "ecc_mode": summary["ecc_mode"],
        "ecc": summary["ecc"],
        "retired_pages": summary["retired"],
        "samples": summary["samples"],
        "loaded_samples": summary["loaded_samples"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=60, help="how long the load runs (the role's default: 300)")
    parser.add_argument("--interval", type=int, default=2, help="seconds between samples (nvidia-smi -l)")
    parser.add_argument("--out", type=Path, required=True, help="directory the record is written to")
    parser.add_argument("--nvidia-smi", default=shutil.which("nvidia-smi") or "/usr/bin/nvidia-smi")
    parser.add_argument("--python", default=sys.executable, help="the Python with CUDA torch that runs the load")
    args = parser.parse_args(argv)
    rules = load_rules()
    smi = args.nvidia_smi
    problems: list[str] = []

    probe = run([smi, "--query-gpu=clocks_event_reasons.hw_slowdown", "--format=csv,noheader"])
    prefix = "clocks_event_reasons" if probe.returncode == 0 else "clocks_throttle_reasons"
    fields = rules.sample_fields(prefix)
    check = run([smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])
    if check.returncode != 0:
        print(f"qualify_check: nvidia-smi refuses the role's sample fields ({prefix}): {check.stdout}{check.stderr}")
        return 2

    torch_info = run([args.python, "-I", "-c", "import torch; print(torch.__version__, torch.version.cuda)"])
    started = datetime.datetime.now(datetime.UTC)
    args.out.mkdir(parents=True, exist_ok=True)
    # A file, not a pipe: a full pipe would stall the sampler of a many-card host while the load runs.
    samples_file = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read back after the sampler ends)
    sampler = subprocess.Popen(
        [
            "timeout",
            str(args.seconds + 120),
            smi,
            f"--query-gpu={','.join(fields)}",
            "--format=csv,noheader,nounits",
            "-l",
            str(args.interval),
        ],
        stdout=samples_file,
        stderr=subprocess.PIPE,
        text=True,
    )
    load = run(
        [args.python, "-I", "-c", (REPO / "owner_scripts" / "gpu_qualify_load.py").read_text(), str(args.seconds)]
    )
    time.sleep(2 * args.interval)  # the last loaded samples, then the cards' drop back
    sampler.terminate()
    sampler_err = sampler.communicate(timeout=30)[1]
    samples_file.seek(0)
    samples_text = samples_file.read()
    if load.returncode != 0:
        problems.append(f"the load exited {load.returncode}: {load.stderr[-2000:]}")
    if sampler_err.strip():
        problems.append(f"nvidia-smi's sampler said: {sampler_err.strip()[-2000:]}")

    smi_q = run([smi, "-q"])
    if smi_q.returncode != 0:
        print(f"qualify_check: nvidia-smi -q failed ({smi_q.returncode}): {smi_q.stdout}{smi_q.stderr}")
        return 2
    xid_lines, log_source = kernel_log()
    if not log_source:
        problems.append("no kernel log could be read (journalctl, dmesg): the Xid check is unproven")
    host = socket.gethostname()
    settings = role_settings(host)
    collected = {"smi_q": smi_q.stdout, "samples": samples_text, "samples_fields": fields, "kernel_log": xid_lines}
    cards = rules.parse_smi_q(smi_q.stdout)
    rows = rules.parse_samples(samples_text, fields)
    if not cards:
        problems.append(f"nvidia-smi -q listed no card the rules could read; its start: {smi_q.stdout[:1500]!r}")
    if not rows:
        problems.append(f"no sample row parsed with the fields {fields}; the sampler's start: {samples_text[:1500]!r}")
    for card in cards:
        problems += card_problems(card)
    verdicts = rules.gpu_qualify_verdicts(collected, {}, settings)
    by_bus = {}
    for row in rows:
        by_bus.setdefault(rules.bus_key(row.get("pci.bus_id", "")), []).append(row)

    record = {
        "schema": SCHEMA,
        "recorded_at": started.isoformat(timespec="seconds"),
        "host": host,
        "gpus": sorted({v["name"] for v in verdicts}),
        "driver_version": cards[0]["driver_version"] if cards else None,
        "torch": torch_info.stdout.strip() or torch_info.stderr.strip()[-500:],
        "seconds": args.seconds,
        "interval": args.interval,
        "reasons_field": prefix,
        "kernel_log_source": log_source,
        "load_rc": load.returncode,
        "settings": settings,
        "collected": collected,
        "cards": [
            {**verdict, "under_load": digest(verdict, by_bus.get(rules.bus_key(verdict["bus_id"]), []))}
            for verdict in verdicts
        ],
        "problems": problems,
    }
    model = re.sub(r"[^a-z0-9]+", "-", (record["gpus"] or ["nogpu"])[0].lower()).strip("-")
    path = args.out / f"qualify-{model}-{started.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for verdict in record["cards"]:
        seen = verdict["under_load"]
        print(
            f"{verdict['where']}: {verdict['verdict']} · max {seen['temperature_c']['max']} °C · SM clock "
            f"{seen['sm_clock_mhz']['min_loaded']}-{seen['sm_clock_mhz']['max']} MHz under load · reasons seen "
            f"{', '.join(seen['throttle_reasons_seen']) or 'none'}"
        )
        for finding in verdict["findings"]:
            print(f"  - {finding['level']}: {finding['reason']}; do: {finding['do']}")
    print(path)
    for problem in problems:
        print(f"qualify_check: PROBLEM: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
