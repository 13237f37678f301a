"""gpu_qualify's decisions: what root's nvidia-smi and kernel log said about each card, one verdict per card out.

The role's tasks only collect text, all of it produced by root (root's own nvidia-smi, the kernel log): the
`nvidia-smi -q` report taken after the load, the `--query-gpu` samples taken during it, and the kernel log since
boot. Nothing the load (an owner process) prints is read. Everything here runs on the controller:
- parse_smi_q / parse_samples / parse_xids read those texts (both driver generations' names);
- gpu_qualify_verdicts judges each card against the role's settings and the card's previous record;
- gpu_qualify_history folds the verdicts into the controller's history, keyed by the card's serial number.
A verdict is pass, warn or fail; every finding names what was seen, on which card, and what to do.
"""

from __future__ import annotations

import re

LEVELS = ("pass", "warn", "fail")
NOT_AVAILABLE = {"", "N/A", "[N/A]", "[Not Supported]", "Not Supported", "[Unknown Error]", "Unknown Error"}
# The two names of the same NVML counters: drivers from R535 say clocks_event_reasons ("Clocks Event Reasons" in
# -q), older ones clocks_throttle_reasons ("Clocks Throttle Reasons").
REASON_PREFIXES = ("clocks_event_reasons", "clocks_throttle_reasons")
REASON_FIELDS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
    "sw_power_cap",
)
# The -q labels of those reasons, as the normalized names above.
REASON_LABELS = {
    "HW Slowdown": "hw_slowdown",
    "HW Thermal Slowdown": "hw_thermal_slowdown",
    "HW Power Brake Slowdown": "hw_power_brake_slowdown",
    "SW Thermal Slowdown": "sw_thermal_slowdown",
    "SW Power Cap": "sw_power_cap",
}
SAMPLE_FIELDS = (
    "index",
    "serial",
    "uuid",
    "pci.bus_id",
    "temperature.gpu",
    "clocks.sm",
    "clocks.max.sm",
    "power.draw",
    "power.limit",
    "utilization.gpu",
    "fan.speed",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
XID_LINE = re.compile(r"NVRM: Xid \(PCI:(?P<bus>[0-9A-Fa-f:.]+)\): (?P<xid>\d+)")
# What a thermal or hardware slowdown means and what to do about it.
SLOWDOWNS = {
    "hw_thermal_slowdown": (
        "HW Thermal Slowdown",
        "improve the airflow through the card (a passive P40 needs a server chassis' forced air across its fins: "
        "ducting, fan speed, a free slot beside it), then re-run qualify",
    ),
    "sw_thermal_slowdown": (
        "SW Thermal Slowdown",
        "improve the airflow through the card (ducting, fan speed, a free slot beside it), then re-run qualify",
    ),
    "hw_power_brake_slowdown": (
        "HW Power Brake Slowdown",
        "the power supply asserted the power brake: check the PSU's capacity and the card's 8-pin EPS cable, "
        "then re-run qualify",
    ),
    "hw_slowdown": (
        "HW Slowdown",
        "the board slowed itself (over-temperature or a power fault): check airflow and the power cable, reseat "
        "the card, then re-run qualify",
    ),
}


def number(text):
    """A float from nvidia-smi's value ("63 C", "249.47 W", "16x", "1303"), None where it has none."""
    text = str(text).strip()
    if text in NOT_AVAILABLE:
        return None
    match = re.match(r"^-?\d+(?:\.\d+)?", text)
    return float(match.group(0)) if match else None


def integer(text):
    value = number(text)
    return None if value is None else int(value)


def bus_key(bus_id):
    """One spelling of a PCI address for matching: nvidia-smi's 00000000:03:00.0 and the kernel log's
    PCI:0000:03:00 both read 0000:03:00."""
    parts = str(bus_id).lower().replace("pci:", "").split(":")
    if len(parts) < 3:
        return str(bus_id).lower()
    return f"{parts[-3][-4:]}:{parts[-2]}:{parts[-1].split('.')[0]}"


# --- nvidia-smi -q ---------------------------------------------------------------------------------------------


def _tree(lines):
    """The indented `Label : value` report as nested dicts (a header line opens a section)."""
    root: dict = {}
    stack = [(-1, root)]
    for line in lines:
        if not line.strip() or line.startswith("="):
            continue
        indent = len(line) - len(line.lstrip(" "))
        label, sep, value = line.strip().partition(":")
        while stack[-1][0] >= indent:
            stack.pop()
        node = stack[-1][1]
        if sep and value.strip():
            node[label.strip()] = value.strip()
        else:
            child: dict = {}
            node[label.strip()] = child
            stack.append((indent, child))
    return root


def _get(tree, *paths):
    """The first path (labels joined by /) that the tree has, else ""."""
    for path in paths:
        node = tree
        for label in path.split("/"):
            node = node.get(label) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            return node
    return ""


def _ecc_counts(errors):
    """(sbe, dbe) totals of one ECC Errors section: Pascal-era rows (Single Bit/Double Bit .../Total) or the newer
    drivers' SRAM/DRAM Correctable/Uncorrectable rows (summed); None where the card reports none (N/A)."""
    if not isinstance(errors, dict):
        return None, None
    if "Single Bit" in errors or "Double Bit" in errors:
        return integer(_get(errors, "Single Bit/Total")), integer(_get(errors, "Double Bit/Total"))
    corrected = [integer(v) for k, v in errors.items() if k.endswith(" Correctable") and not isinstance(v, dict)]
    uncorrected = [integer(v) for k, v in errors.items() if k.endswith(" Uncorrectable") and not isinstance(v, dict)]
    corrected, uncorrected = [v for v in corrected if v is not None], [v for v in uncorrected if v is not None]
    return (sum(corrected) if corrected else None), (sum(uncorrected) if uncorrected else None)


# A card's process list, the last section of its block: each process's name as the process set it, newlines and all.
PROCESSES = re.compile(r"^ {4}Processes\b")


class SmiReportError(ValueError):
    """A report whose structure a process name could have forged: it is not judged."""


def _without_processes(body):
    """A card's lines up to its process list: what follows it is the processes' own text (a name may hold a newline
    and lines that look like the card's: `    Serial Number : ...`, a whole `ECC Errors` section)."""
    lines = body.splitlines()
    end = next((i for i, line in enumerate(lines) if PROCESSES.match(line)), len(lines))
    return lines[:end]


def parse_smi_q(text, host="this host"):
    """The cards of one `nvidia-smi -q` report, each as the facts the verdict reads. Each card's process list is left
    out; a report with more GPU sections than its header's `Attached GPUs` (a process name can print a `GPU <bus>`
    line of its own), or with one bus id or serial twice, raises SmiReportError."""
    sections = re.split(r"^GPU (?=[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:)", text, flags=re.MULTILINE)
    head = _tree(sections[0].splitlines())
    driver = _get(head, "Driver Version")
    attached = integer(_get(head, "Attached GPUs"))
    if attached is not None and attached != len(sections) - 1:
        raise SmiReportError(
            f"{host}: root's nvidia-smi -q lists {len(sections) - 1} GPU section(s) where its header says Attached "
            f"GPUs {attached}: a process's name (printed as it is) can make a section of its own, so the report is "
            "not judged; do: stop the processes on the cards (nvidia-smi lists them) and qualify again"
        )
    cards = []
    for section in sections[1:]:
        bus_line, _, body = section.partition("\n")
        gpu = _tree(_without_processes(body))
        reasons_label = next((k for k in ("Clocks Event Reasons", "Clocks Throttle Reasons") if k in gpu), "")
        # Drivers too old for the card answer the whole section with one "N/A".
        reasons_node = gpu.get(reasons_label) if isinstance(gpu.get(reasons_label), dict) else {}
        flat_reasons = {}
        for label, value in reasons_node.items():
            if isinstance(value, dict):
                flat_reasons.update({k: v for k, v in value.items() if not isinstance(v, dict)})
            else:
                flat_reasons[label] = value
        volatile_sbe, volatile_dbe = _ecc_counts(_get(gpu, "ECC Errors/Volatile"))
        aggregate_sbe, aggregate_dbe = _ecc_counts(_get(gpu, "ECC Errors/Aggregate"))
        power = gpu.get("GPU Power Readings") or gpu.get("Power Readings") or {}
        power = power if isinstance(power, dict) else {}
        pending = str(_get(gpu, "Retired Pages/Pending Page Blacklist", "Retired Pages/Pending")).strip()
        cards.append(
            {
                "bus_id": bus_line.strip(),
                "name": _get(gpu, "Product Name"),
                "serial": _get(gpu, "Serial Number"),
                "uuid": _get(gpu, "GPU UUID"),
                "driver_version": driver,
                "persistence_mode": _get(gpu, "Persistence Mode"),
                "reasons_field": "clocks_event_reasons"
                if reasons_label == "Clocks Event Reasons"
                else "clocks_throttle_reasons",
                "reasons": {
                    REASON_LABELS[label]: value == "Active"
                    for label, value in flat_reasons.items()
                    if label in REASON_LABELS
                },
                "pcie": {
                    "gen_max": integer(_get(gpu, "PCI/GPU Link Info/PCIe Generation/Max")),
                    "gen_current": integer(_get(gpu, "PCI/GPU Link Info/PCIe Generation/Current")),
                    "width_max": integer(_get(gpu, "PCI/GPU Link Info/Link Width/Max")),
                    "width_current": integer(_get(gpu, "PCI/GPU Link Info/Link Width/Current")),
                },
                "ecc_mode": _get(gpu, "ECC Mode/Current", "Ecc Mode/Current"),
                "ecc": {
                    "volatile_sbe": volatile_sbe,
                    "volatile_dbe": volatile_dbe,
                    "aggregate_sbe": aggregate_sbe,
                    "aggregate_dbe": aggregate_dbe,
                },
                "retired": {
                    "sbe": integer(_get(gpu, "Retired Pages/Single Bit ECC")),
                    "dbe": integer(_get(gpu, "Retired Pages/Double Bit ECC")),
                    "pending": pending == "Yes",
                },
                "temperature": {
                    "current": integer(_get(gpu, "Temperature/GPU Current Temp")),
                    "slowdown": integer(_get(gpu, "Temperature/GPU Slowdown Temp")),
                    "shutdown": integer(_get(gpu, "Temperature/GPU Shutdown Temp")),
                },
                "power": {
                    "draw": number(power.get("Power Draw", "")),
                    "limit": number(power.get("Power Limit", power.get("Current Power Limit", ""))),
                    "default_limit": number(power.get("Default Power Limit", "")),
                    "max_limit": number(power.get("Max Power Limit", "")),
                },
                "clocks": {
                    "sm": integer(_get(gpu, "Clocks/SM")),
                    "max_sm": integer(_get(gpu, "Max Clocks/SM")),
                },
            }
        )
    named = (("bus id", lambda c: bus_key(c["bus_id"]), lambda c: c["bus_id"]), ("serial", card_id, card_id))
    for what, key, shown in named:
        keys = [key(c) for c in cards]
        twice = sorted({shown(c) for c in cards if key(c) and keys.count(key(c)) > 1})
        if twice:
            raise SmiReportError(
                f"{host}: root's nvidia-smi -q names {what} {', '.join(twice)} for more than one card: one card's "
                "history would overwrite another's, so the report is not judged; do: stop the processes on the cards "
                "(a process's name can forge a card's lines) and qualify again"
            )
    return cards


# --- nvidia-smi --query-gpu samples ----------------------------------------------------------------------------


def sample_fields(prefix):
    """The --query-gpu fields the samples ask for, with the reason fields under this driver's prefix."""
    return list(SAMPLE_FIELDS) + [f"{prefix}.{name}" for name in REASON_FIELDS]


def parse_samples(text, fields):
    """One dict per row of `--query-gpu=<fields> --format=csv,noheader,nounits` (sampled with -l): numbers as
    numbers (None for [N/A]), the reasons as booleans under their normalized names, whichever prefix was asked."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [cell.strip() for cell in line.split(",")]
        if len(cells) != len(fields):
            continue  # a row cut short by the sampler's end (timeout) is no sample
        row = {}
        for field, cell in zip(fields, cells, strict=True):
            prefix, _, name = field.partition(".")
            if prefix in REASON_PREFIXES:
                row[name] = cell == "Active"
            elif field in ("serial", "uuid", "pci.bus_id"):
                row[field] = cell
            else:
                row[field] = number(cell)
        rows.append(row)
    return rows


# --- the kernel log --------------------------------------------------------------------------------------------


def parse_xids(text):
    """Xid events per card (bus_key) from the kernel log since boot: {bus: {xid: count}}."""
    found: dict = {}
    for match in XID_LINE.finditer(text):
        counts = found.setdefault(bus_key(match.group("bus")), {})
        xid = int(match.group("xid"))
        counts[xid] = counts.get(xid, 0) + 1
    return found


# --- the verdict -----------------------------------------------------------------------------------------------


def card_id(card):
    """The key a card's history is kept under: its serial number, else (cards without one) its UUID."""
    serial = str(card.get("serial", "")).strip()
    return serial if serial and serial not in NOT_AVAILABLE else str(card.get("uuid", ""))


def _loaded(samples, settings):
    return [s for s in samples if (s.get("utilization.gpu") or 0) >= settings["load_min_utilization"]]


def _max(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return max(values) if values else None


def _min(rows, key):
    values = [r[key] for r in rows if r.get(key) is not None]
    return min(values) if values else None


def card_verdict(card, samples, xids, previous, settings):
    """pass/warn/fail for one card: its -q facts, its samples under load, its Xid counts, its previous record."""
    where = f"{settings['host']} GPU {card['bus_id']} ({card['name']}, serial {card_id(card)})"
    findings = []

    def find(level, reason, do):
        findings.append({"level": level, "reason": reason, "do": do})

    loaded = _loaded(samples, settings)
    peak_temp = _max(samples, "temperature.gpu")
    seen = {name: [s for s in samples if s.get(name)] for name in REASON_FIELDS}
    # The -q report after the load counts too: a reason active there was reached.
    reached = {name for name, rows in seen.items() if rows} | {n for n, on in card["reasons"].items() if on}
    summary = {
        "samples": len(samples),
        "loaded_samples": len(loaded),
        "max_utilization": _max(samples, "utilization.gpu"),
        "max_temperature": peak_temp,
        "min_sm_clock_loaded": _min(loaded, "clocks.sm"),
        "max_sm_clock": card["clocks"]["max_sm"] or _max(samples, "clocks.max.sm"),
        "max_power": _max(samples, "power.draw"),
        "power_limit": card["power"]["limit"],
        "reasons_seen": sorted(reached),
        "reasons_field": card["reasons_field"],
        "pcie_loaded": {
            "gen": _min(loaded, "pcie.link.gen.current"),
            "width": _min(loaded, "pcie.link.width.current"),
            "gen_max": card["pcie"]["gen_max"],
            "width_max": card["pcie"]["width_max"],
        },
        "ecc_mode": card["ecc_mode"],
        "ecc": card["ecc"],
        "retired": card["retired"],
        "xids": {str(k): v for k, v in sorted(xids.items())},
        "persistence_mode": card["persistence_mode"],
    }

    # Under load at all: without it nothing below about temperature, clocks or the link is proven.
    if not samples:
        find(
            "fail",
            "no sample of this card was taken during the load",
            "check that root's nvidia-smi answers --query-gpu on the host, then re-run qualify",
        )
    elif len(loaded) < settings["min_loaded_samples"]:
        find(
            "fail",
            f"the load did not reach the card: {len(loaded)} of {len(samples)} samples at >= "
            f"{settings['load_min_utilization']}% utilization (max {summary['max_utilization']:.0f}%), so cooling "
            "and the link are unproven",
            "check that the load ran on this card (gpu_qualify_load_command, the env's torch sees it), then re-run "
            "qualify",
        )

    # Cooling and power.
    temp_text = f"{peak_temp:.0f} °C" if peak_temp is not None else "an unread temperature"
    slowdown_temp = card["temperature"]["slowdown"]
    for name, (label, do) in SLOWDOWNS.items():
        if name in reached:
            first = seen[name][0] if seen[name] else {}
            at = f" (first at {first['temperature.gpu']:.0f} °C)" if first.get("temperature.gpu") is not None else ""
            find("fail", f"{label} reached under load at a peak of {temp_text}{at}", do)
    thermal = {"hw_thermal_slowdown", "sw_thermal_slowdown", "hw_slowdown"} & reached
    if not thermal and peak_temp is not None and slowdown_temp and peak_temp >= slowdown_temp:
        find(
            "fail",
            f"reached {temp_text}, at or above the card's slowdown temperature of {slowdown_temp} °C",
            SLOWDOWNS["hw_thermal_slowdown"][1],
        )
    elif not thermal and peak_temp is not None and peak_temp >= settings["max_temperature_c"]:
        find(
            "warn",
            f"reached {temp_text} under load (gpu_qualify_max_temperature_c: {settings['max_temperature_c']} °C"
            + (f", slowdown at {slowdown_temp} °C" if slowdown_temp else "")
            + "): little headroom for a multi-day run",
            "improve the airflow through the card before long runs",
        )
    if "sw_power_cap" in reached:
        limit = card["power"]["limit"]
        limit_text = f" of {limit:.0f} W" if limit else ""
        find(
            "warn",
            f"held at its power limit{limit_text} under load (SW Power Cap, peak draw "
            f"{summary['max_power'] or 0:.0f} W); clocks drop while it holds",
            "expected for a P40 at full fp32 load; where the clocks drop far, set a power limit it holds at "
            "(nvidia-smi -pl) and check the PSU",
        )
    default_limit = card["power"]["default_limit"]
    if card["power"]["limit"] and default_limit and card["power"]["limit"] < default_limit:
        find(
            "warn",
            f"power limit {card['power']['limit']:.0f} W is below the card's default {default_limit:.0f} W",
            "keep it if it was set on purpose (heat, PSU); else restore it with nvidia-smi -pl",
        )
    if card["persistence_mode"] != "Enabled":
        find(
            "warn",
            f"persistence mode is {card['persistence_mode'] or 'unknown'}: the driver state is torn down between "
            "jobs, so each start re-initializes the card",
            "enable nvidia-persistenced (or nvidia-smi -pm 1)",
        )

    # Memory errors.
    ecc, retired = card["ecc"], card["retired"]
    if card["ecc_mode"] == "Disabled":
        find(
            "warn",
            "ECC is disabled: memory errors are neither corrected nor counted",
            "enable it (nvidia-smi -e 1) and reboot",
        )
    dbe = [f"{kind} {ecc[key]}" for kind, key in (("volatile", "volatile_dbe"), ("aggregate", "aggregate_dbe"))]
    if (ecc["volatile_dbe"] or 0) > 0 or (ecc["aggregate_dbe"] or 0) > 0:
        find(
            "fail",
            f"double-bit (uncorrectable) ECC errors: {', '.join(dbe)}",
            "take the card out of training; if they recur after a reboot, replace (RMA) the card",
        )
    if retired["pending"]:
        find(
            "fail",
            "a retired page is pending: it takes effect only at the next driver load",
            "reboot the host (or reload the driver), then re-run qualify",
        )
    retired_total = (retired["sbe"] or 0) + (retired["dbe"] or 0)
    if retired_total >= settings["retired_pages_max"]:
        find(
            "fail",
            f"{retired_total} retired pages ({retired['sbe'] or 0} single-bit, {retired['dbe'] or 0} double-bit), "
            f"at or above gpu_qualify_retired_pages_max ({settings['retired_pages_max']})",
            "replace (RMA) the card",
        )
    elif retired_total > 0:
        find(
            "warn",
            f"{retired_total} retired pages ({retired['sbe'] or 0} single-bit, {retired['dbe'] or 0} double-bit)",
            "watch it: qualify names the card as getting worse when the count grows",
        )
    for xid, count in sorted(xids.items()):
        level = "fail" if xid in settings["xid_fail"] else "warn"
        what = settings["xid_meaning"].get(xid, settings["xid_meaning"].get(str(xid), "see NVIDIA's Xid catalog"))
        find(
            level,
            f"Xid {xid} ({what}) {count} time(s) in the kernel log since boot",
            "replace (RMA) the card if it recurs after a reboot; reseat it first for Xid 79"
            if level == "fail"
            else "look at the kernel log around it; an application fault is the job's, not the card's",
        )

    # The link under load (an idle P40 drops to a lower generation to save power: only loaded samples count).
    link = summary["pcie_loaded"]
    if link["width"] is not None and link["width_max"] and link["width"] < link["width_max"]:
        find(
            "warn",
            f"PCIe link x{link['width']:.0f} under load, the card's maximum x{link['width_max']}",
            "move the card to an x16 slot or reseat it (a riser or slot wired x8 halves host-device bandwidth)",
        )
    if link["gen"] is not None and link["gen_max"] and link["gen"] < link["gen_max"]:
        find(
            "warn",
            f"PCIe link generation {link['gen']:.0f} under load, the card's maximum {link['gen_max']}",
            "reseat the card, check the slot's generation in the BIOS settings and the riser",
        )

    # Getting worse since the last run: counts that only grow, compared with the card's record on the controller.
    before = (previous or {}).get("summary") or {}
    worse = []
    for label, now, then in (
        ("retired pages", retired_total, _retired_total(before.get("retired"))),
        ("aggregate single-bit ECC errors", ecc["aggregate_sbe"], (before.get("ecc") or {}).get("aggregate_sbe")),
        ("aggregate double-bit ECC errors", ecc["aggregate_dbe"], (before.get("ecc") or {}).get("aggregate_dbe")),
    ):
        if now is not None and then is not None and now > then:
            worse.append(f"{label} {then} -> {now}")
    if worse:
        find(
            "warn",
            f"getting worse since the last qualification ({previous.get('checked_at', 'earlier')}): "
            + ", ".join(worse),
            "plan the card's replacement; keep it out of long runs while the count grows",
        )
    if previous and previous.get("verdict") == "fail" and not any(f["level"] == "fail" for f in findings):
        find(
            "warn",
            f"failed its last qualification ({previous.get('checked_at', 'earlier')}): "
            + "; ".join(previous.get("reasons", [])[:3]),
            "make sure the cause was fixed, not just absent this time",
        )

    verdict = max((f["level"] for f in findings), key=LEVELS.index, default="pass")
    return {
        "host": settings["host"],
        "id": card_id(card),
        "serial": card["serial"],
        "uuid": card["uuid"],
        "bus_id": card["bus_id"],
        "name": card["name"],
        "driver_version": card["driver_version"],
        "verdict": verdict,
        "where": where,
        "getting_worse": bool(worse),
        "findings": findings,
        "reasons": [f["reason"] for f in findings],
        "summary": summary,
    }


def _retired_total(retired):
    if not retired:
        return None
    return (retired.get("sbe") or 0) + (retired.get("dbe") or 0)


# The most of a failed command's output a verdict carries: its message is at its start (nvidia-smi) or end.
MESSAGE_LINES = 12


def _output_message(text):
    lines = [line.rstrip() for line in str(text or "").splitlines() if line.strip()]
    if len(lines) > MESSAGE_LINES:
        lines = [*lines[: MESSAGE_LINES // 2], "...", *lines[-MESSAGE_LINES // 2 :]]
    return "\n".join(lines)


def sampler_finding(collected):
    """The fail finding of a sampler that stopped by itself (nvidia-smi refused a field, or died), in its own words;
    None when it sampled until the load ended (files/sampler.py exits 0 then)."""
    rc = int(collected.get("sampler_rc") or 0)
    if rc == 0:
        return None
    said = _output_message(collected.get("samples")) or "nothing"
    return {
        "level": "fail",
        "reason": f"root's nvidia-smi stopped sampling (exit {rc}), so the card was not seen under load; it said: "
        f"{said}",
        "do": "run the same nvidia-smi --query-gpu on the host as root and fix what it says (a field the driver "
        "does not know: a newer driver, or gpu_qualify_nvidia_smi pointing at the wrong tool), then re-run qualify",
    }


def gpu_qualify_failure_message(result):
    """A failed task's own words (ansible_failed_result): its msg, and a command's output where msg is only
    Ansible's "non-zero return code"."""
    result = result if isinstance(result, dict) else {}
    items = [item for item in result.get("results") or [] if isinstance(item, dict) and item.get("failed")]
    if items:  # a loop: each failed item in its own words
        return "\n".join(gpu_qualify_failure_message({**item, "results": None}) for item in items)
    msg = str(result.get("msg") or "").strip()
    output = _output_message(result.get("stderr") or result.get("stdout") or result.get("module_stderr") or "")
    if output and (not msg or msg == "non-zero return code" or "rc" in result):
        rc = result.get("rc")
        msg = f"{msg or 'failed'}{f' (exit {rc})' if rc is not None else ''}: {output}"
    return msg or "failed without a message"


def gpu_qualify_verdicts(collected, history, settings):
    """One verdict per card of a host. `collected`: the texts root's commands returned (smi_q, samples,
    samples_fields, sampler_rc, kernel_log); `history`: the controller's record ({'cards': {id: last verdict}})."""
    cards = parse_smi_q(collected["smi_q"], settings.get("host", "this host"))
    stopped = sampler_finding(collected)
    samples = [] if stopped else parse_samples(collected["samples"], collected["samples_fields"])
    xids = parse_xids(collected.get("kernel_log", ""))
    known = (history or {}).get("cards") or {}
    verdicts = []
    for position, card in enumerate(cards):
        key = bus_key(card["bus_id"])
        mine = [s for s in samples if bus_key(s.get("pci.bus_id", "")) == key]
        previous = (known.get(card_id(card)) or {}).get("last")
        verdict = card_verdict(card, mine, xids.get(key, {}), previous, settings)
        if stopped:
            findings = [stopped, *verdict["findings"]]
            reasons = [f["reason"] for f in findings]
            verdict = {**verdict, "verdict": "fail", "findings": findings, "reasons": reasons}
        # nvidia-smi's index as its samples give it; -q lists the cards in that same (PCI bus) order.
        index = next((s["index"] for s in mine if s.get("index") is not None), position)
        verdicts.append({**verdict, "index": int(index)})
    return verdicts


def gpu_qualify_message(verdicts):
    """The failure message of a host: every failed card with its fail findings and what to do."""
    lines = []
    for verdict in verdicts:
        if verdict["verdict"] != "fail":
            continue
        lines.append(f"{verdict['where']}: fail")
        lines += [f"  - {f['reason']}; do: {f['do']}" for f in verdict["findings"] if f["level"] == "fail"]
    return "\n".join(lines)


def gpu_qualify_history(history, verdicts, checked_at, keep=20, topologies=(), failures=()):
    """The controller's history with these verdicts folded in: per card, the last verdict and a short trail; per
    host, its last topology (gpu_qualify_topology), whose nccl_environment the launch script takes, and the failure
    that stopped its last qualification before any card was judged ({host, task, message}; a later qualification
    that judged the cards clears it)."""
    cards = dict((history or {}).get("cards") or {})
    hosts = dict((history or {}).get("hosts") or {})
    for topology in topologies or ():
        if topology:
            hosts[topology["host"]] = {"checked_at": checked_at, **topology}
    for failure in failures or ():
        if failure:
            kept = hosts.get(failure["host"]) or {}
            hosts[failure["host"]] = {**kept, "failure": {"checked_at": checked_at, **failure}}
    for verdict in verdicts:
        record = dict(verdict, checked_at=checked_at)
        old = cards.get(verdict["id"]) or {}
        entry = {
            "checked_at": checked_at,
            "host": verdict["host"],
            "verdict": verdict["verdict"],
            "max_temperature": verdict["summary"]["max_temperature"],
            "retired": verdict["summary"]["retired"],
            "ecc": verdict["summary"]["ecc"],
        }
        trail = [*(old.get("trail") or []), entry]
        cards[verdict["id"]] = {"last": record, "trail": trail[-keep:]}
    return {"schema": 1, "cards": cards, "hosts": hosts}


# --- the topology of a multi-GPU host ----------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-9;]*m")
P2P_MEANING = {
    "OK": "OK",
    "CNS": "chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "topology not supported",
    "NS": "not supported",
    "DR": "disabled by regkey",
    "U": "unknown",
}


def matrix_gpus(text):
    """How many GPUs a topo matrix's header names (1 on a one-GPU host, whose matrix has no pair)."""
    head = next((ANSI.sub("", line) for line in text.splitlines() if line.strip()), "")
    return len([c for c in head.split("\t") if re.fullmatch(r"GPU\d+", c.strip())])


def parse_gpu_matrix(text):
    """The GPU-to-GPU cells of `nvidia-smi topo -m` or `topo -p2p r`: {(i, j): cell} for i < j (the ANSI underline of
    the header and the legend left out)."""
    lines = [ANSI.sub("", line) for line in text.split("\nLegend:")[0].splitlines() if line.strip()]
    if not lines:
        return {}
    columns = [c.strip() for c in lines[0].split("\t") if c.strip()]
    gpus = [c for c in columns if re.fullmatch(r"GPU\d+", c)]
    cells = {}
    for line in lines[1:]:
        parts = [c.strip() for c in line.strip().split("\t")]
        if not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            continue
        row = int(parts[0][3:])
        for name, value in zip(gpus, parts[1 : 1 + len(gpus)], strict=False):
            col = int(name[3:])
            if row < col:
                cells[(row, col)] = value
    return cells


def gpu_qualify_topology(collected, host):
    """What a host's topology needs (root's `nvidia-smi topo -m`, `topo -p2p r` and /proc/cmdline): each pair of GPUs,
    its link and whether P2P reads work; where a pair's P2P does not, NCCL_P2P_DISABLE=1 for the launch environment
    (NCCL would otherwise try P2P between them and hang or corrupt) and a hint at the IOMMU or ACS. A host of one GPU
    has nothing to say."""
    links = parse_gpu_matrix(collected.get("topo_m") or "")
    p2p = parse_gpu_matrix(collected.get("topo_p2p_r") or "")
    cmdline = collected.get("cmdline") or ""
    pairs = [
        {"gpus": list(pair), "link": links.get(pair), "p2p_read": p2p.get(pair)}
        for pair in sorted(set(links) | set(p2p))
    ]
    findings = []
    if collected.get("topo_rc", 0) != 0 and len(pairs) == 0:
        findings.append(
            {
                "level": "warn",
                "reason": f"nvidia-smi topo answered {collected.get('topo_rc')}: the P2P status between the cards is "
                "unknown, so NCCL is left to find out",
                "do": "run `nvidia-smi topo -p2p r` on the host; where it is not OK, set launch_script_environment: "
                "{NCCL_P2P_DISABLE: '1'}",
            }
        )
    broken = [p for p in pairs if p["p2p_read"] not in (None, "OK")]
    environment = {"NCCL_P2P_DISABLE": "1"} if broken else {}
    if broken:
        words = cmdline.split()
        iommu = [w for w in words if re.match(r"^(intel_iommu|amd_iommu)=on$", w)]
        passthrough = "iommu=pt" in words
        if iommu and not passthrough:
            hint = (
                f"the IOMMU is on ({' '.join(iommu)} in the kernel command line) without iommu=pt: add iommu=pt "
                "(or turn the IOMMU off) and turn ACS off on the PCIe bridges between the cards in the BIOS, reboot"
            )
        else:
            hint = (
                "check ACS on the PCIe bridges between the cards (`lspci -vvv | grep ACSCtl`: SrcValid+ redirects "
                "peer traffic) and the IOMMU in the BIOS; turn them off for these slots or move the cards under one "
                "PCIe switch, reboot"
            )
        shown = ", ".join(
            f"GPU{a}-GPU{b} {p['p2p_read']} ({P2P_MEANING.get(p['p2p_read'], 'unknown')}"
            + (f", link {p['link']}" if p["link"] else "")
            + ")"
            for p in broken
            for a, b in [p["gpus"]]
        )
        findings.append(
            {
                "level": "warn",
                "reason": f"P2P reads do not work between {shown}: the launch environment gets NCCL_P2P_DISABLE=1 "
                "(NCCL copies through host memory instead, slower but safe)",
                "do": hint + "; then re-run qualify, which drops the setting once P2P works",
            }
        )
    return {
        "host": host,
        "gpus": max(matrix_gpus(collected.get("topo_m") or ""), matrix_gpus(collected.get("topo_p2p_r") or "")),
        "pairs": pairs,
        "nccl_environment": environment,
        "findings": findings,
    }


def gpu_qualify_refusals(history, host, accept=(), history_file="the controller's history"):
    """Why a host may not train (the cluster plan, the smoke): each of its cards whose last qualification failed,
    unless the inventory accepts that card by serial (gpu_qualify_accept). A host never qualified is not refused."""
    accepted = {str(serial).strip() for serial in accept or ()}
    refusals = []
    for card, record in sorted(((history or {}).get("cards") or {}).items()):
        last = (record or {}).get("last") or {}
        if last.get("host") != host or last.get("verdict") != "fail" or card in accepted:
            continue
        reasons = "; ".join(f["reason"] for f in last.get("findings") or [] if f.get("level") == "fail")
        refusals.append(
            f"{host}: GPU {last.get('bus_id')} ({last.get('name')}, serial {card}) failed its last qualification "
            f"({last.get('checked_at', 'earlier')}, {history_file}): {reasons or 'see the history'}; do: fix what it "
            f"names and run `p40fleet qualify -l {host}` again, or, to train on the card anyway, add its serial to "
            f'gpu_qualify_accept for {host} in the inventory (gpu_qualify_accept: ["{card}"])'
        )
    return refusals


class FilterModule:
    def filters(self):
        return {
            "gpu_qualify_verdicts": gpu_qualify_verdicts,
            "gpu_qualify_history": gpu_qualify_history,
            "gpu_qualify_message": gpu_qualify_message,
            "gpu_qualify_failure_message": gpu_qualify_failure_message,
            "gpu_qualify_refusals": gpu_qualify_refusals,
            "gpu_qualify_topology": gpu_qualify_topology,
            "gpu_qualify_sample_fields": sample_fields,
        }
