"""What `p40fleet report` and `p40fleet train status` promise, in text too (no containers): the text report has the
card table and the training runs the HTML has, the HTML's tiles count what its cards say, and `train status` is
never cut to a width without a terminal, has a JSON output, the log's path, step X of Y and resumed runs marked."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from p40fleet import fleet, html_report, train
from p40fleet.state import StateDir
from tests.test_card_table import report, three_hosts
from tests.test_train_report import status

pytestmark = pytest.mark.unit


def test_the_text_report_has_the_card_table_and_the_training_runs(tmp_path, capsys):
    hosts, history = three_hosts()
    inventory = (tmp_path / "hosts.yml").resolve()
    resumed = status("node2", step=60, total=100)
    resumed["progress"].update(resumes=1, resumed_from=[40])
    train.save_runs(StateDir(tmp_path / "state"), inventory, [status("node1"), resumed], "2026-12-07T10:00:00+00:00")
    data, _ = report(tmp_path, hosts, history, "report-text")
    assert len(data["runs"]) == 2
    err = capsys.readouterr().err
    assert "GPU qualification: 5 cards on 3 hosts: 2 fail, 2 warn, 1 pass" in err
    hot = next(line for line in err.splitlines() if "serial 0324617040112-node3" in line)
    assert hot.startswith("  node3 GPU 0 serial 0324617040112-node3 (Tesla P40): fail · max 92 °C · HW slowdown, ")
    assert "HW Thermal Slowdown reached under load at a peak of 92 °C" in hot
    assert "Training runs (their last status, as `p40fleet train` saw it):" in err
    assert "  node2 gsm8k: running (resumed) · step 60 of 100 · " in err
    assert "log node1:/home/p40fleet/.p40fleet/train/gsm8k.log" in err


def test_train_status_is_never_cut_without_a_terminal_and_marks_resumed_runs():
    runs = [status(f"node{i:03d}-with-a-long-rack-name", state="running") for i in range(3)]
    runs[1]["progress"].update(resumes=2)
    runs[2]["progress"].update(step=None, total_steps=None)
    out = io.StringIO()
    train.print_runs(Console(file=out, width=80, highlight=False), runs)
    lines = out.getvalue().splitlines()
    assert "…" not in out.getvalue()
    assert lines[1].startswith("  node000-with-a-long-rack-name gsm8k: running · step 40 of 100 · s/step 31.5")
    assert lines[1].endswith("log node000-with-a-long-rack-name:/home/p40fleet/.p40fleet/train/gsm8k.log")
    assert "gsm8k: running (resumed 2x) · step 40 of 100" in lines[2]
    assert "gsm8k: running · s/step" in lines[3]  # no step yet: none shown, never "None of None"
    assert "None" not in out.getvalue()


def test_train_status_wide_on_a_terminal_and_json_on_standard_output(capsys):
    out = io.StringIO()
    train.print_runs(Console(file=out, width=400, force_terminal=True, highlight=False), [status("node1")], wide=True)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert "started" in text and "node1:/home/p40fleet/.p40fleet/train/gsm8k.log" in text
    train.write_json([status("node1")], "-")
    document = json.loads(capsys.readouterr().out)
    assert document["schema"] == train.SCHEMA and document["runs"][0]["log"].endswith("gsm8k.log")


def test_every_tile_counts_the_cards_that_say_its_words():
    """Converged hosts whose last run was ok: the cards say so in their footer, the tiles count statuses; no tile
    may read 0 under the words every card shows."""
    saved = {
        "hosts": {
            h: {
                "last_run": {"state": "ok", "finished": "2026-12-07T10:00:00+00:00", "stats": {"ok": 3}},
                "probe": {"preflight": {}, "verified": {}},
                "probed_at": "2026-12-07T10:00:00+00:00",
            }
            for h in ("node1", "node2")
        }
    }
    saved["hosts"]["node3"] = {"last_run": {"state": "interrupted", "finished": "2026-12-07T10:00:00+00:00"}}
    records = fleet.host_records(saved)
    page = html_report.render_html(fleet.fleet_report(records, "hosts.yml"))
    tiles = dict(
        (label, int(n)) for n, label in re.findall(r'<span class="n">(\d+)</span><span class="l">([^<]+)</span>', page)
    )
    pills = re.findall(r'<span class="pill">([^<]+)</span>', page)
    footers = re.findall(r"<footer>(last run <b>[^<]+</b>)", page)
    for label, count in tiles.items():
        if label != "hosts":
            assert count == pills.count(label), (label, tiles, pills)
    # The footers' words are no tile's.
    assert not set(tiles) & {re.sub("<[^>]+>", "", f) for f in footers}
    assert tiles["run interrupted"] == 1 and tiles["hosts"] == 3
