"""The training runs' section of the fleet report's HTML page (html_report.render_html adds it): a table with one
row per run (host, run, state, step, s/step, scores, checkpoint, expected end) and, in each row, a small inline
SVG of its train score and validation score against the step. No script, nothing fetched; every value came from a
host, so text is escaped and only numbers reach the plot."""

from __future__ import annotations

import math
from html import escape

from p40fleet.train import network, row

CSS = """
.runs { padding: 0 32px 40px; }
.runs h2 { font-size: 18px; margin: 0 0 10px; }
.runs table { border-collapse: collapse; width: 100%; background: #fff; border: 1px solid var(--line); }
.runs th, .runs td { padding: 5px 10px; border-bottom: 1px solid #eaeef2; text-align: left; font-size: 13px; }
.runs th { color: var(--muted); font-size: 11px; text-transform: uppercase; letter-spacing: .5px; }
.runs td.num { font-family: var(--mono); text-align: right; }
.runs .why { color: var(--muted); font-size: 12px; }
.runs .st { font-weight: 600; }
.runs .st-running { color: var(--ok); } .runs .st-finished { color: var(--converged); }
.runs .st-failed, .runs .st-rebooted { color: var(--failed); } .runs .st-stopped { color: var(--drift); }
.runs svg { display: block; }
.runs .net { font-size: 12px; margin-top: 2px; } .runs .net-pass { color: var(--muted); }
.runs .net-warn { color: var(--drift); } .runs .net-fail, .runs .net-error { color: var(--failed); }
.runs .legend { color: var(--muted); font-size: 12px; margin: 6px 0 0; }
.runs .legend b.t { color: #0969da; } .runs .legend b.v { color: #cf222e; }
"""
WIDTH, HEIGHT, PAD = 220, 56, 4
HEADERS = ("host", "run", "state", "step", "s/step", "train", "val", "ckpt", "expected end", "score by step")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def plot(history) -> str:
    """The train score (blue line) and the validation score (red dots) against the step, scores 0..1 clamped."""
    points = [p for p in history or [] if isinstance(p, (list, tuple)) and len(p) == 3 and _finite(p[0])]
    if not points:
        return '<span class="none">no steps yet</span>'
    first, last = min(p[0] for p in points), max(p[0] for p in points)
    span = max(last - first, 1)

    def xy(step, score):
        x = PAD + (step - first) / span * (WIDTH - 2 * PAD)
        y = HEIGHT - PAD - min(max(score, 0.0), 1.0) * (HEIGHT - 2 * PAD)
        return f"{x:.1f},{y:.1f}"

    train = " ".join(xy(p[0], p[1]) for p in points if _finite(p[1]))
    val = "".join(
        f'<circle cx="{xy(p[0], p[2]).split(",")[0]}" cy="{xy(p[0], p[2]).split(",")[1]}" r="2.5" fill="#cf222e"/>'
        for p in points
        if _finite(p[2])
    )
    return (
        f'<svg width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="score by step, {first} to {last}">'
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#f6f8fa"/>'
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD}" y2="{HEIGHT - PAD}" stroke="#d0d7de"/>'
        + (f'<polyline points="{train}" fill="none" stroke="#0969da" stroke-width="1.5"/>' if train else "")
        + val
        + "</svg>"
    )


def render_runs(runs: list[dict]) -> str:
    """The section, '' when no run is known."""
    if not runs:
        return ""
    lines = []
    for run in runs:
        cells = row(run)
        state = cells[2]
        why = run.get("why") if run.get("state") != "member" else ""
        verdict, measured = network(run)
        tds = [
            f"<td>{escape(cells[0])}</td>",
            f"<td>{escape(cells[1])}</td>",
            f'<td><span class="st st-{escape(state)}">{escape(state)}</span>'
            + (f'<div class="why">{escape(str(why))}</div>' if why else "")
            + (f'<div class="net net-{verdict}">network {verdict}: {escape(measured)}</div>' if measured else "")
            + "</td>",
            *(f'<td class="num">{escape(c)}</td>' for c in cells[3:8]),
            f"<td>{escape(cells[8])}</td>",
            f"<td>{plot((run.get('progress') or {}).get('history'))}</td>",
        ]
        lines.append(f'<tr id="run-{escape(cells[0])}-{escape(cells[1])}">{"".join(tds)}</tr>')
    head = "".join(f"<th>{h}</th>" for h in HEADERS)
    return (
        f'<style>{CSS}</style><section class="runs"><h2>training runs ({len(runs)})</h2>'
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(lines)}</tbody></table>"
        '<p class="legend">score by step: <b class="t">train score</b> (line), '
        '<b class="v">validation score</b> (dots), 0 to 1</p></section>'
    )
