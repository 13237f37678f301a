"""`p40fleet report`'s card table: a row per GPU from the controller's qualification history, as JSON and as a
sortable HTML table, looked at by headless Chromium at 3 hosts and at 100.

The history is the one roles/gpu_qualify's filter writes, built here by that filter from the stand-in cards
(python/tests/fixtures/standins/gpu_qualify/); no containers.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from p40fleet import card_table, cli
from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module
from tests.test_fleet_report import CHROMIUM, _png_size, screenshot
from tests.test_gpu_qualify_rules import settings

from .conftest import TEST_OUTPUT

pytestmark = pytest.mark.unit

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "gpu_qualify.py", "gpu_qualify_rules")
STANDINS = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "gpu_qualify"
CARDS = ["p40-healthy", "p40-thermal", "p40-power-cap", "p40-ecc-errors", "p40-retiring", "p40-x8", "p40-r470"]


RETIRED = ("Single Bit ECC                    : 6", "Single Bit ECC                    : 2")
SETTINGS = settings()


def verdicts(host: str, names: list[str], history: dict, earlier: bool = False) -> list[dict]:
    """The filter's verdicts for a host whose cards are these stand-ins, each serial made the host's own; earlier:
    as the retiring card was a run before (2 retired pages where it now has 6)."""
    out = []
    for name in names:
        case = yaml.safe_load((STANDINS / f"{name}.yml").read_text())
        serial = re.search(r"Serial Number\s+: (\S+)", case["smi_q"]).group(1)
        smi_q = case["smi_q"].replace(serial, f"{serial}-{host}")
        if earlier:
            smi_q = smi_q.replace(*RETIRED)
        collected = {
            "smi_q": smi_q,
            "samples": case["samples"].replace(serial, f"{serial}-{host}"),
            "samples_fields": RULES.sample_fields(case["reasons_prefix"]),
            "kernel_log": case["kernel_log"],
        }
        [verdict] = RULES.gpu_qualify_verdicts(collected, history, {**SETTINGS, "host": host})
        out.append(dict(verdict, index=len(out)))  # one recorded card per stand-in: the host's Nth is index N
    return out


def fleet_history(hosts: dict[str, list[str]]) -> dict:
    """Two qualifications of the fleet a day apart; between them the retiring cards' retired pages grew 2 -> 6."""
    first = [v for host, names in hosts.items() for v in verdicts(host, names, {}, earlier=True)]
    history = RULES.gpu_qualify_history({}, first, "2026-12-04T09:00:00+00:00")
    second = [v for host, names in hosts.items() for v in verdicts(host, names, history)]
    return RULES.gpu_qualify_history(history, second, "2026-12-05T09:00:00+00:00")


def report(tmp_path, hosts: dict[str, list[str]], history: dict, name: str) -> tuple[dict, str]:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": {h: {"ansible_port": 9} for h in hosts}}}}})
    )
    state = tmp_path / "state"
    path = cli.qualify_history_path(state, inventory.resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history))
    TEST_OUTPUT.mkdir(parents=True, exist_ok=True)
    json_path, html_path = TEST_OUTPUT / f"{name}.json", TEST_OUTPUT / f"{name}.html"
    argv = ["report", "-i", str(inventory), "--state-dir", str(state), "--json", str(json_path)]
    assert cli.main([*argv, "--html", str(html_path)]) == cli.EXIT_OK
    return json.loads(json_path.read_text()), html_path.read_text()


def three_hosts() -> tuple[dict[str, list[str]], dict]:
    hosts = {"node1": ["p40-healthy", "p40-x8"], "node2": ["p40-retiring", "p40-power-cap"], "node3": ["p40-thermal"]}
    return hosts, fleet_history(hosts)


def test_rows_from_the_history_failed_first_with_every_column(tmp_path):
    hosts, history = three_hosts()
    data, page = report(tmp_path, hosts, history, "card-table-3")
    rows = data["cards"]
    assert [(r["host"], r["verdict"]) for r in rows] == [
        ("node2", "fail"),
        ("node3", "fail"),
        ("node1", "warn"),
        ("node2", "warn"),
        ("node1", "pass"),
    ]
    hot = rows[1]
    assert hot["serial"] == "0324617040112-node3" and hot["model"] == "Tesla P40" and hot["index"] == 0
    assert hot["max_temperature"] == 92
    assert hot["throttle_reasons"] == ["hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown"]
    assert hot["reasons"][0] == "HW Thermal Slowdown reached under load at a peak of 92 °C (first at 92 °C)"
    slot = rows[2]
    assert slot["pcie"] == {"gen": 3, "width": 8, "gen_max": 3, "width_max": 16}
    assert rows[0]["retired"] == {"sbe": 6, "dbe": 0, "pending": True} and rows[0]["trend"] == "getting worse"
    assert [r["trend"] for r in rows[1:]] == ["steady"] * 4
    # The page: one table row per card, the sort script inline, nothing fetched.
    assert page.count('<tr class="v-') == 5
    assert "<script>" in page and "<link" not in page and "<img" not in page
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", page)
    assert '<td class="worse">getting worse</td>' in page
    assert ">gen3 x8 of x16<" in page and ">gen3 x16<" in page
    if CHROMIUM is None:
        pytest.skip("chromium is not installed: run `make test-deps`")
    png = screenshot(TEST_OUTPUT / "card-table-3.html", TEST_OUTPUT / "card-table-3.png")
    assert _png_size(png) == (1400, 1700) and png.stat().st_size > 50_000
    print(f"screenshot: {png}")
    # The sort, run by the browser: a click on "max °C" sorts the rows by temperature, a second click reverses.
    assert sorted_temperatures(tmp_path, page, clicks=1) == [69, 70, 71, 74, 92]
    assert sorted_temperatures(tmp_path, page, clicks=2) == [92, 74, 71, 70, 69]


def sorted_temperatures(tmp_path, page: str, clicks: int) -> list[int]:
    column = [label for _, label in card_table.COLUMNS].index("max °C")
    click = f'document.querySelectorAll("table.cards th")[{column}].click();' * clicks
    clicked = tmp_path / f"clicked-{clicks}.html"
    clicked.write_text(page.replace("</body>", f"<script>{click}</script></body>"))
    done = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--proxy-server=http://127.0.0.1:9",
            "--dump-dom",
            clicked.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [int(t) for t in re.findall(r'<td class="num" data-sort="[\d.-]+">(\d+)</td><td class="wrap">', done.stdout)]


def test_a_card_of_a_host_no_longer_in_the_inventory_is_left_out_and_text_is_escaped(tmp_path):
    hosts = {"node1": ["p40-healthy"]}
    history = fleet_history({**hosts, "gone": ["p40-thermal"]})
    [key] = [k for k, v in history["cards"].items() if v["last"]["host"] == "node1"]
    history["cards"][key]["last"]["name"] = "<b>Tesla</b> & co"
    data, page = report(tmp_path, hosts, history, "card-table-escape")
    assert [r["host"] for r in data["cards"]] == ["node1"]
    assert "&lt;b&gt;Tesla&lt;/b&gt; &amp; co" in page and "<b>Tesla</b>" not in page


def test_no_history_no_table():
    assert card_table.card_rows({}) == [] and card_table.render_card_table([]) == ""


def test_a_hundred_hosts(tmp_path):
    hosts = {f"gpu{i:03d}": [CARDS[(i + k) % len(CARDS)] for k in range(1 + i % 4)] for i in range(1, 101)}
    history = fleet_history(hosts)
    data, page = report(tmp_path, hosts, history, "card-table-100")
    assert len(data["cards"]) == sum(len(v) for v in hosts.values()) == page.count('<tr class="v-')
    verdicts_in_order = [r["verdict"] for r in data["cards"]]
    assert verdicts_in_order == sorted(verdicts_in_order, key=card_table.VERDICT_ORDER.get)
    if CHROMIUM is None:
        pytest.skip("chromium is not installed: run `make test-deps`")
    png = screenshot(TEST_OUTPUT / "card-table-100.html", TEST_OUTPUT / "card-table-100.png")
    assert _png_size(png) == (1400, 1700) and png.stat().st_size > 50_000
    print(f"screenshot: {png}")
