"""The fleet report's card table: one row per GPU from the controller's qualification history.

`p40fleet qualify` (roles/gpu_qualify) keeps each card's last verdict and a short trail, keyed by serial number, in
the inventory's state directory. `card_rows` turns that record into the report's rows (JSON), `render_card_table`
into an HTML section: a table sortable by any column (a few lines of inline script, nothing fetched), failed cards
first, in a scrolling box with a fixed header so that a fleet of a hundred hosts stays readable.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from html import escape
from pathlib import Path

VERDICT_ORDER = {"fail": 0, "warn": 1, "pass": 2}
COLUMNS = (
    ("host", "host"),
    ("index", "GPU"),
    ("serial", "serial"),
    ("model", "model"),
    ("verdict", "verdict"),
    ("reasons", "reasons"),
    ("max_temperature", "max °C"),
    ("throttle_reasons", "throttle reasons"),
    ("pcie", "PCIe loaded"),
    ("memory", "ECC SBE/DBE · retired"),
    ("trend", "trend"),
)

# The throttle reasons (roles/gpu_qualify's normalized names) as the table shows them, short.
REASON_SHORT = {
    "hw_slowdown": "HW slowdown",
    "hw_thermal_slowdown": "HW thermal",
    "hw_power_brake_slowdown": "power brake",
    "sw_thermal_slowdown": "SW thermal",
    "sw_power_cap": "power cap",
}

CSS = """
.cards-section { padding: 24px 32px 0; }
.cards-section h2 { margin: 0 0 4px; font-size: 18px; }
.cards-section .note { margin: 0 0 10px; }
.card-scroll {
  max-height: 78vh; overflow: auto; background: #fff; border: 1px solid var(--line); border-radius: 8px;
}
table.cards { border-collapse: collapse; width: 100%; font-size: 12.5px; }
table.cards th {
  position: sticky; top: 0; z-index: 1; background: #eaeef2; text-align: left; padding: 6px 8px;
  cursor: pointer; white-space: nowrap; user-select: none; border-bottom: 1px solid var(--line);
}
table.cards th[aria-sort=ascending]::after { content: " ▲"; }
table.cards th[aria-sort=descending]::after { content: " ▼"; }
table.cards td { padding: 4px 8px; border-bottom: 1px solid #eaeef2; vertical-align: top; white-space: nowrap; }
table.cards td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.cards td.mono { font-family: var(--mono); white-space: nowrap; }
table.cards td.reasons { white-space: normal; min-width: 220px; max-width: 290px; }
table.cards td.wrap { white-space: normal; min-width: 110px; max-width: 150px; }
table.cards td.reasons summary {
  cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; max-width: 280px;
}
table.cards td.reasons ul { margin: 2px 0 0; }
table.cards td.reasons .more { color: var(--muted); }
table.cards tr.v-fail td:first-child { box-shadow: inset 4px 0 var(--failed); }
table.cards tr.v-warn td:first-child { box-shadow: inset 4px 0 var(--drift); }
.verdict { color: #fff; border-radius: 999px; padding: 1px 8px; font-size: 11px; font-weight: 600;
  text-transform: uppercase; }
.verdict.fail { background: var(--failed); } .verdict.warn { background: var(--drift); }
.verdict.pass { background: var(--converged); }
.worse { color: var(--failed); font-weight: 600; }
"""

# Sort on click: numbers by data-sort, text by its content; a second click reverses. No library, nothing fetched.
SCRIPT = """
document.querySelectorAll("table.cards th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var body = th.closest("table").tBodies[0], up = th.getAttribute("aria-sort") !== "ascending";
    th.parentNode.querySelectorAll("th").forEach(function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", up ? "ascending" : "descending");
    var key = function (row) {
      var c = row.cells[col]; return c.dataset.sort !== undefined ? c.dataset.sort : c.textContent;
    };
    var rows = Array.prototype.slice.call(body.rows).sort(function (a, b) {
      var x = key(a), y = key(b), n = parseFloat(x) - parseFloat(y);
      return (isNaN(n) ? x.localeCompare(y) : n) * (up ? 1 : -1);
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""


def read_history(path: Path) -> dict:
    """The controller's history (roles/gpu_qualify's gpu_qualify_history), {} where none was kept yet."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _trend(record: dict) -> str:
    last = record.get("last") or {}
    trail = record.get("trail") or []
    if last.get("getting_worse"):
        return "getting worse"
    if len(trail) < 2:
        return "first run"
    before = trail[-2].get("verdict")
    if before != last.get("verdict"):
        return f"was {before}"
    return "steady"


def _worst_first(last: dict) -> list[str]:
    findings = last.get("findings") or [{"level": "warn", "reason": r} for r in last.get("reasons") or []]
    ranked = sorted(findings, key=lambda f: VERDICT_ORDER.get(f.get("level"), 3))
    return [f["reason"] for f in ranked]


def card_rows(history: dict, hosts: Iterable[str] | None = None) -> list[dict]:
    """One row per card whose last qualification was on one of `hosts` (all where None): failed first."""
    wanted = None if hosts is None else set(hosts)
    rows = []
    for card_id, record in ((history or {}).get("cards") or {}).items():
        last = record.get("last") or {}
        if wanted is not None and last.get("host") not in wanted:
            continue
        summary = last.get("summary") or {}
        link = summary.get("pcie_loaded") or {}
        ecc = summary.get("ecc") or {}
        retired = summary.get("retired") or {}
        rows.append(
            {
                "host": last.get("host"),
                "index": last.get("index"),
                "bus_id": last.get("bus_id"),
                "serial": last.get("serial") or card_id,
                "model": last.get("name"),
                "verdict": last.get("verdict"),
                "reasons": _worst_first(last),
                "max_temperature": summary.get("max_temperature"),
                "throttle_reasons": list(summary.get("reasons_seen") or []),
                "pcie": link,
                "ecc": ecc,
                "retired": retired,
                "trend": _trend(record),
                "checked_at": last.get("checked_at"),
            }
        )
    rows.sort(key=lambda r: (VERDICT_ORDER.get(r["verdict"], 3), str(r["host"]), r["index"] or 0))
    return rows


def _e(value) -> str:
    return escape("" if value is None else str(value))


def _pcie(link: dict) -> tuple[str, str]:
    if link.get("width") is None:
        return "—", "-1"
    text = f"gen{link['gen']:.0f} x{link['width']:.0f}"
    short = [f"gen{m}" for k, m in (("gen", link.get("gen_max")),) if m and link[k] < m]
    short += [f"x{m}" for k, m in (("width", link.get("width_max")),) if m and link[k] < m]
    if short:
        text += f" of {' '.join(short)}"  # below the card's maximum: what it could have
    return text, f"{link['width']:.0f}.{link['gen']:.0f}"


def _memory(row: dict) -> tuple[str, int]:
    ecc, retired = row["ecc"], row["retired"]
    pages = (retired.get("sbe") or 0) + (retired.get("dbe") or 0)

    def count(value):
        return "—" if value is None else str(value)

    parts = [
        f"{count(ecc.get('aggregate_sbe'))}/{count(ecc.get('aggregate_dbe'))}",
        f"{pages} pages" + (", pending" if retired.get("pending") else ""),
    ]
    return " · ".join(parts), pages * 1000 + (ecc.get("aggregate_dbe") or 0)


def _row(row: dict) -> str:
    verdict = row["verdict"] or "unknown"
    pcie, pcie_key = _pcie(row["pcie"])
    memory, memory_key = _memory(row)
    temp = row["max_temperature"]
    first, *rest = row["reasons"] or [None]
    if first is None:
        reasons = '<span class="none">—</span>'
    elif not rest:
        reasons = _e(first)
    else:
        # One line per card, the worst finding first; the others open on a click (no script needed).
        more = "".join(f"<li>{_e(r)}</li>" for r in rest)
        reasons = (
            f'<details><summary>{_e(first)} <span class="more">(+{len(rest)})</span></summary><ul>{more}</ul></details>'
        )
    trend = row["trend"]
    none = '<span class="none">—</span>'
    throttle = _e(", ".join(REASON_SHORT.get(r, r) for r in row["throttle_reasons"])) or none
    trend_class = ' class="worse"' if trend == "getting worse" else ""
    rank = VERDICT_ORDER.get(verdict, 3)
    cells = [
        f"<td>{_e(row['host'])}</td>",
        f'<td class="num" data-sort="{_e(row["index"] if row["index"] is not None else -1)}">{_e(row["index"])}</td>',
        f'<td class="mono">{_e(row["serial"])}</td>',
        f"<td>{_e(row['model'])}</td>",
        f'<td data-sort="{rank}"><span class="verdict {_e(verdict)}">{_e(verdict)}</span></td>',
        f'<td class="reasons">{reasons}</td>',
        f'<td class="num" data-sort="{_e(temp if temp is not None else -1)}">'
        f"{_e(f'{temp:.0f}') if temp is not None else '—'}</td>",
        f'<td class="wrap">{throttle}</td>',
        f'<td class="mono" data-sort="{_e(pcie_key)}">{_e(pcie)}</td>',
        f'<td class="mono" data-sort="{memory_key}">{_e(memory)}</td>',
        f"<td{trend_class}>{_e(trend)}</td>",
    ]
    return f'<tr class="v-{_e(verdict)}">{"".join(cells)}</tr>'


def summary_line(rows: list[dict]) -> str:
    counts = Counter(r["verdict"] for r in rows)
    hosts = len({r["host"] for r in rows})
    return (
        f"{len(rows)} cards on {hosts} hosts: {counts.get('fail', 0)} fail, {counts.get('warn', 0)} warn,"
        f" {counts.get('pass', 0)} pass (p40fleet qualify; each card's last run)"
    )


def card_lines(rows: list[dict]) -> list[str]:
    """The card table as text, one line per card (failed first) with every column the HTML has; the reasons come
    from the hosts' own reports, so control characters are left out."""
    from p40fleet.progress import printable

    lines = [f"GPU qualification: {summary_line(rows)}"] if rows else []
    for row in rows:
        temp = row["max_temperature"]
        throttle = ", ".join(REASON_SHORT.get(r, r) for r in row["throttle_reasons"]) or "no throttling"
        cells = [
            f"max {temp:.0f} °C" if temp is not None else "max °C —",
            throttle,
            f"PCIe {_pcie(row['pcie'])[0]}",
            f"ECC SBE/DBE · retired {_memory(row)[0]}",
            row["trend"],
        ]
        head = f"  {row['host']} GPU {row['index']} serial {row['serial']} ({row['model']}): {row['verdict']}"
        reasons = "; ".join(row["reasons"])
        lines.append(printable(" · ".join([head, *cells]) + (f" · {reasons}" if reasons else "")))
    return lines


def render_card_table(rows: list[dict]) -> str:
    """The HTML section (with its style and script) for the report's rows; "" where no card was qualified."""
    if not rows:
        return ""
    head = "".join(f'<th scope="col">{_e(label)}</th>' for _, label in COLUMNS)
    body = "\n".join(_row(r) for r in rows)
    return f"""<section class="cards-section" id="cards">
<style>{CSS}</style>
<h2>GPU qualification</h2>
<p class="note">{_e(summary_line(rows))}. Click a column to sort.</p>
<div class="card-scroll">
<table class="cards">
<thead><tr>{head}</tr></thead>
<tbody>
{body}
</tbody>
</table>
</div>
<script>{SCRIPT}</script>
</section>"""
