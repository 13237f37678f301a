"""The fleet report as one static HTML page: inline CSS, nothing fetched (the card table's sort is the one script).

A header with the fleet's totals, then one card per host (hosts that need attention first): its
status in colour, GPU, driver and profile with the reasons for it, the stack's versions, the patch
set, the launch script, what drifted, the last run and, for a host that failed, the first failure
verbatim.
"""

from __future__ import annotations

from datetime import UTC, datetime
from html import escape

from p40fleet import card_table
from p40fleet.fleet import STATUSES
from p40fleet.html_runs import render_runs
from p40fleet.run_time import run_time

ORDER = {
    status: index
    for index, status in enumerate(("failed", "unreachable", "interrupted", "drift", "unknown", "ok", "converged"))
}
LABELS = {
    "converged": "converged",
    # Not "last run ok": every card's footer says how its last run went, converged hosts' too; this status is a host
    # whose last run went well and whose state was not read since.
    "ok": "ran ok, not probed",
    "drift": "drift",
    "failed": "failed",
    "unreachable": "unreachable",
    "interrupted": "run interrupted",
    "unknown": "not seen yet",
}

CSS = """
:root {
  --converged: #1a7f37; --ok: #0f7b6c; --drift: #b35900; --failed: #cf222e; --unreachable: #8250df;
  --interrupted: #9a6700; --unknown: #6e7781; --ink: #1f2328; --muted: #656d76; --line: #d0d7de; --paper: #f6f8fa;
  --mono: ui-monospace, "DejaVu Sans Mono", monospace;
}
* { box-sizing: border-box; }
body {
  margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
  color: var(--ink); background: var(--paper);
}
header { background: #0d1117; color: #f0f6fc; padding: 22px 32px 20px; }
header h1 { margin: 0 0 4px; font-size: 22px; letter-spacing: .2px; }
header .meta { margin: 0; color: #9198a1; font-size: 13px; }
header code { color: #c9d1d9; }
.totals { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 16px; }
.total {
  min-width: 108px; padding: 8px 14px; border-radius: 8px; background: #161b22;
  border: 1px solid #30363d; border-top: 4px solid #484f58;
}
.total .n { display: block; font-size: 26px; font-weight: 700; line-height: 1.1; }
.total .l { color: #9198a1; font-size: 12px; text-transform: uppercase; letter-spacing: .6px; }
.total.zero { opacity: .45; }
main {
  display: grid; grid-template-columns: repeat(auto-fill, minmax(420px, 1fr)); gap: 18px;
  padding: 24px 32px 40px; align-items: start;
}
.card {
  background: #fff; border: 1px solid var(--line); border-left: 6px solid var(--unknown); border-radius: 8px;
  padding: 14px 18px 12px; box-shadow: 0 1px 2px rgba(31, 35, 40, .06);
  display: flex; flex-direction: column; gap: 10px;
}
.card-head { display: flex; align-items: center; justify-content: space-between; gap: 12px; }
.card h2 { margin: 0; font-size: 18px; font-family: var(--mono); }
.pill {
  color: #fff; background: var(--unknown); border-radius: 999px; padding: 2px 10px; font-size: 12px;
  font-weight: 600; text-transform: uppercase; letter-spacing: .5px; white-space: nowrap;
}
.gpu { font-size: 15px; font-weight: 600; }
.gpu .sub { color: var(--muted); font-weight: 400; font-size: 13px; }
h3 { margin: 0 0 4px; font-size: 12px; text-transform: uppercase; letter-spacing: .6px; color: var(--muted); }
.profile b { color: var(--ink); text-transform: none; letter-spacing: 0; font-size: 13px; }
ul { margin: 0; padding-left: 18px; }
li { margin: 1px 0; }
.versions {
  display: grid; grid-template-columns: repeat(3, 1fr); gap: 6px 12px; margin: 0; padding: 10px 12px;
  background: var(--paper); border-radius: 6px;
}
.versions div { min-width: 0; }
.versions dt { color: var(--muted); font-size: 11px; text-transform: uppercase; letter-spacing: .5px; }
.versions dd { margin: 0; font-family: var(--mono); font-size: 13px; overflow-wrap: anywhere; }
.none { color: #8c959f; }
code { font-family: var(--mono); font-size: 12.5px; overflow-wrap: anywhere; }
.drift { border-left: 3px solid var(--drift); padding-left: 10px; }
.failure h3 { color: var(--failed); }
.failure .task { font-weight: 600; margin-bottom: 6px; }
.failure.unreachable h3 { color: var(--unreachable); }
pre {
  margin: 0; padding: 10px 12px; background: #fff5f5; border: 1px solid #ffcecb; border-radius: 6px;
  white-space: pre-wrap; overflow-wrap: anywhere; font: 12.5px/1.45 var(--mono); color: #82071e;
}
.failure.unreachable pre { background: #fbf7ff; border-color: #d8b9ff; color: #512a97; }
.note { color: var(--muted); font-size: 12.5px; }
.card footer {
  margin-top: auto; padding-top: 8px; border-top: 1px solid #eaeef2; color: var(--muted); font-size: 12.5px;
}
.card footer b { color: var(--ink); font-weight: 600; }
.empty { padding: 40px 32px; color: var(--muted); }
"""
for _status in STATUSES:
    CSS += (
        f".card.s-{_status} {{ border-left-color: var(--{_status}); }}\n"
        f".s-{_status} .pill {{ background: var(--{_status}); }}\n"
        f".total.s-{_status} {{ border-top-color: var(--{_status}); }}\n"
    )


def _e(value) -> str:
    """Every field of the page is host- or run-supplied text: escaped, whatever its type."""
    return escape("" if value is None else str(value))


def _v(value) -> str:
    return _e(str(value)) if value not in (None, "", []) else '<span class="none">—</span>'


def _versions(host: dict) -> str:
    cuda = host.get("cuda")
    patch = host.get("patch_set")
    if patch and host.get("patch_state") and host["patch_state"] != "patched":
        patch = f"{patch} ({host['patch_state']})"
    elif not patch and host.get("patch_state"):
        patch = host["patch_state"]
    apex = host.get("apex")
    if apex and host.get("apex_built_by"):
        apex = f"{apex} (built by {host['apex_built_by']})"
    verl = host.get("verl")
    if verl and host.get("verl_head"):
        verl = f"{verl} @ {str(host['verl_head'])[:10]}"
    cells = [
        ("CUDA", cuda),
        ("cuDNN", host.get("cudnn")),
        ("torch", host.get("torch")),
        ("Apex", apex),
        ("verl", verl),
        ("patch set", patch),
    ]
    return '<dl class="versions">' + "".join(f"<div><dt>{k}</dt><dd>{_v(v)}</dd></div>" for k, v in cells) + "</dl>"


def _when(text: str | None) -> str:
    """An ISO time as people read it: 2026-11-30 10:02 UTC."""
    if not text:
        return "?"
    try:
        moment = datetime.fromisoformat(str(text).replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        # Whatever a host's file said, shown as text, never as markup.
        return _e(text)
    return f"{moment:%Y-%m-%d %H:%M} UTC"


def _failure(failure: dict) -> str:
    kind = " unreachable" if failure.get("unreachable") else ""
    role = f"[{_e(failure['role'])}] " if failure.get("role") else ""
    return (
        f'<section class="failure{kind}"><h3>{"unreachable" if kind else "first failure"}</h3>'
        f'<div class="task">{role}{_e(failure.get("task", ""))}</div>'
        f"<pre>{_e(failure.get('message', ''))}</pre></section>"
    )


def _card(host: dict) -> str:
    status = host.get("status", "unknown")
    parts = [
        f'<article class="card s-{_e(status)}" id="host-{_e(host["host"])}">',
        f'<div class="card-head"><h2>{_e(host["host"])}</h2>'
        f'<span class="pill">{_e(LABELS.get(status, status))}</span></div>',
    ]
    known = host.get("state_source") is not None
    if known:
        facts = []
        if host.get("driver"):
            facts.append(f"driver {_e(host['driver'])}")
        if host.get("kernel_module"):
            facts.append(f"{_e(host['kernel_module'])} module")
        if host.get("driver_hold"):
            facts.append(_e(host["driver_hold"]))
        if host.get("gpu_memory_mib"):
            facts.append(f"{_e(host['gpu_memory_mib'])} MiB per GPU")
        if host.get("ecc"):
            facts.append(f"ECC {_e(host['ecc'])}")
        if host.get("compute_cap"):
            facts.append(f"compute capability {_e(host['compute_cap'])}")
        if host.get("os"):
            facts.append(_e(host["os"]))
        parts.append(f'<div class="gpu">{_v(host.get("gpu"))}<div class="sub">{" · ".join(facts)}</div></div>')
    if host.get("first_failure"):
        parts.append(_failure(host["first_failure"]))
    if host.get("probe_error"):
        parts.append(f'<div class="note">state probe: {_e(host["probe_error"])}</div>')
    if not known:
        parts.append('<div class="note">No state read from this host yet.</div>')
    if host.get("profile") or host.get("profile_reasons"):
        reasons = "".join(f"<li>{_e(r)}</li>" for r in host.get("profile_reasons") or [])
        parts.append(
            f'<section class="profile"><h3>profile <b>{_v(host.get("profile"))}</b>, because</h3>'
            f"<ul>{reasons}</ul></section>"
        )
    if host.get("drift"):
        items = "".join(
            f"<li><b>{_e(stage)}</b>: {_e('; '.join(reasons))}</li>" for stage, reasons in host["drift"].items()
        )
        parts.append(f'<section class="drift"><h3>not converged</h3><ul>{items}</ul></section>')
    if host.get("state_source") == "fleet_state probe":
        parts.append(_versions(host))
        script = f"<code>{_e(host['launch_script'])}</code>" if host.get("launch_script") else _v(None)
        parts.append(f'<div class="launch"><h3>launch script</h3>{script}</div>')
        if host.get("driver_pinned"):
            held = f"; on hold: {', '.join(host['driver_on_hold'])}" if host.get("driver_on_hold") else ""
            parts.append(
                f'<div class="launch"><h3>driver hold</h3>{escape(host.get("driver_hold") or "")}: pinned '
                f"{escape(', '.join(host['driver_pinned']) + held)}</div>"
            )
    elif known:
        parts.append(
            '<div class="note">The stack (CUDA, torch, verl, ...) has not been read from this host:'
            " <code>p40fleet report --refresh</code> reads it.</div>"
        )
    smoke = host.get("smoke")
    if isinstance(smoke, dict):
        verdict = "passed" if smoke.get("ok") is True else "failed"
        parts.append(
            f'<div class="smoke"><h3>smoke run <b>{verdict}</b> {escape(_when(str(smoke.get("at") or "")))}</h3>'
            f"<code>{escape(str(smoke.get('summary', '')))}</code></div>"
        )
    # The run's expected duration: measured by a full-batch smoke, else the estimate (docs/estimate.md).
    duration = run_time(smoke)
    if duration:
        parts.append(f'<div class="smoke"><h3>run time</h3>{escape(duration)}</div>')
    if known:
        notes = [f"read by {_e(host['state_source'])} {_when(host.get('state_at'))}"]
        if host.get("verified_at"):
            notes.append(f"stack verified {_when(host['verified_at'])}")
        parts.append(f'<div class="note">{" · ".join(notes)}</div>')
    last = host.get("last_run")
    if last:
        stats = last.get("stats") or {}
        counts = ", ".join(f"{k} {_e(stats.get(k, 0))}" for k in ("ok", "changed", "failures", "unreachable"))
        playbook = (last.get("playbook") or "").rsplit("/", 1)[-1]
        extra = " --check" if last.get("check") else ""
        extra += f" --tags {_e(last['tags'])}" if last.get("tags") else ""
        parts.append(
            f"<footer>last run <b>{_e(last.get('state', ''))}</b> {_when(last.get('finished'))} · "
            f"{_e(playbook)}{extra} · {counts}<br><code>{_e(last.get('run_id', ''))}</code></footer>"
        )
    else:
        parts.append("<footer>no run recorded for this host yet</footer>")
    parts.append("</article>")
    return "\n".join(parts)


def render_html(report: dict) -> str:
    """The page for a fleet report (p40fleet.fleet-report/v1, as fleet.fleet_report makes it)."""
    totals = report.get("totals", {})
    tiles = [
        f'<div class="total"><span class="n">{_e(totals.get("hosts", 0))}</span><span class="l">hosts</span></div>'
    ]
    for status in STATUSES:
        n = totals.get(status, 0)
        zero = " zero" if not n else ""
        tiles.append(
            f'<div class="total s-{status}{zero}"><span class="n">{_e(n)}</span>'
            f'<span class="l">{_e(LABELS[status])}</span></div>'
        )
    hosts = sorted(report.get("hosts", []), key=lambda h: (ORDER.get(h.get("status"), 9), h["host"]))
    cards = "\n".join(_card(h) for h in hosts) or '<p class="empty">No hosts known yet: run p40fleet run first.</p>'
    return f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>p40fleet · fleet report</title>
<style>{CSS}</style>
</head>
<body>
<header>
<h1>p40fleet · fleet report</h1>
<p class="meta">inventory <code>{_e(report.get("inventory", ""))}</code>
 · generated {_when(report.get("generated"))}</p>
<div class="totals">{"".join(tiles)}</div>
</header>
{card_table.render_card_table(report.get("cards") or [])}
<main>
{cards}
</main>
{render_runs(report.get("runs") or [])}
</body>
</html>
"""
