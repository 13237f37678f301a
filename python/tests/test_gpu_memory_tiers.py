"""A card trains as it reports itself: the memory tier follows the total nvidia-smi prints with the card's ECC state,
and the report says what ECC costs.

Each P40 total below is one real cards print (docs/facts-memory.md cites the outputs): 22919 and 23040 MiB with ECC on
(older and newer drivers), 24451 and 24576 MiB with it off, and 22888 MiB, the smallest figure quoted for one (the
capacity the P40 defaults are sized for). Each goes through gpu_preflight's own rules
(plugins/plugin_utils/gpu_preflight.py, on a probe report), the launch script's memory tier is the one of
launch_script_memory_tiers the profile's memory reaches (plugins/filter/launch_script.py), and the launch_script role
renders from the profile they publish (tests/launch_render.py).
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import render
from tests.source_modules import load_module
from tests.test_gpu_preflight_rules import ASSESS, PROBE, report, settings

RULES = load_module(REPO_ROOT / "plugins" / "plugin_utils" / "gpu_preflight.py", "gpu_preflight_ecc_rules")
LAUNCH = load_module(REPO_ROOT / "plugins" / "filter" / "launch_script.py", "launch_script_tier_filters")
TIERS = yaml.safe_load((REPO_ROOT / "roles" / "launch_script" / "defaults" / "main.yml").read_text())[
    "launch_script_memory_tiers"
]
INBAND = ["Tesla P40", "Tesla P4", "Tesla T4"]
# (reported MiB, ECC state as the probe reads it)
P40_TOTALS = {
    "p40-22888": (22888, "on"),
    "p40-22919": (22919, "on"),
    "p40-23040": (23040, "on"),
    "p40-24451": (24451, "off"),
    "p40-24576": (24576, "off"),
}


def p40_profile(memory_mib: int, ecc: str, count: int = 1) -> dict:
    gpu = {"name": "Tesla P40", "compute_cap": "6.1", "memory_mib": memory_mib, "ecc": ecc, "ecc_pending": ecc}
    result = ASSESS(report(gpus=[gpu] * count), settings("host", {}))
    assert result["errors"] == [], result["errors"]
    return result["facts"]["gpu_preflight_profile"]


@pytest.mark.parametrize("name", sorted(P40_TOTALS))
def test_a_p40_gets_the_24_gb_tier_whatever_its_ecc_state(name):
    memory, ecc = P40_TOTALS[name]
    profile = p40_profile(memory, ecc)
    assert (profile["name"], profile["dtype"], profile["memory_mib"], profile["ecc"]) == (
        "pascal",
        "float32",
        memory,
        ecc,
    )
    tier = LAUNCH.memory_tier(profile["memory_mib"], TIERS)
    assert tier["min_memory_mib"] <= min(m for m, _ in P40_TOTALS.values())
    assert tier == LAUNCH.memory_tier(24576, TIERS)
    assert not tier["refuse"], tier
    assert any(reason.startswith(f"ECC {ecc}: Tesla P40 reports {memory} MiB") for reason in profile["reasons"])


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    hosts = {name: {"profile": p40_profile(*found)} for name, found in P40_TOTALS.items()}
    return render(hosts, tmp_path_factory.mktemp("p40-totals"))[0]


@pytest.mark.parametrize("name", sorted(P40_TOTALS))
def test_each_p40_total_renders_a_launch_script(rendered, name):
    """The ECC-on P40 (22919 MiB) fell to the 16 GB tier before, and its script was refused."""
    found = rendered[name]
    assert not found.refused and found.script is not None, found.refused
    overrides = dict(o.lstrip("+").split("=", 1) for o in found.overrides)
    tier = LAUNCH.memory_tier(P40_TOTALS[name][0], TIERS)
    micro = overrides["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
    assert micro == str(tier["ppo_micro_batch_size_per_gpu"])

    # One rendering for both ECC states (the host's name aside): the defaults are sized for the smaller card.
    def unnamed(host):
        return [o.replace(host, "HOST") for o in rendered[host].overrides]

    assert unnamed(name) == unnamed("p40-22888")


def test_the_probe_reads_ecc_as_nvidia_smi_prints_it():
    fields = PROBE.QUERY_FIELDS
    assert fields[-2:] == ["ecc.mode.current", "ecc.mode.pending"]
    out = (
        "0, Tesla P40, 6.1, 23040, 550.127.05, 00000000:03:00.0, Enabled, Disabled\n"
        "1, Tesla P40, 6.1, 24576, 550.127.05, 00000000:04:00.0, Disabled, Disabled\n"
        "2, NVIDIA GeForce GTX 1080 Ti, 6.1, 11264, 550.127.05, 00000000:05:00.0, [N/A], [N/A]\n"
    )
    found = [(g["memory_mib"], g["ecc"], g["ecc_pending"]) for g in PROBE.parse_gpus(fields, out)]
    assert found == [(23040, "on", "off"), (24576, "off", "off"), (11264, "", "")]


def gpu(index, memory, ecc, pending=None, name="Tesla P40"):
    return {"index": index, "name": name, "memory_mib": memory, "ecc": ecc, "ecc_pending": pending or ecc}


P40_22919 = {"name": "Tesla P40", "compute_cap": "6.1", "memory_mib": 22919, "ecc": "on", "ecc_pending": "on"}


ECC_NOTES = {
    "on": (
        [gpu(0, 23040, "on")],
        "on",
        "ECC on: Tesla P40 reports 23040 MiB; ECC keeps about 1536 MiB (1/16 of the memory) and about 20% of its "
        "bandwidth. Off (nvidia-smi -e 0 and a reboot: the operator's call, never p40fleet's) it would report about "
        "24576 MiB; the launch defaults fit either state, so that buys bandwidth, not a larger batch, and memory "
        "errors would go uncorrected",
    ),
    "off": (
        [gpu(0, 24576, "off")],
        "off",
        "ECC off: Tesla P40 reports 24576 MiB; memory errors are neither corrected nor counted. On (the Tesla "
        "default) it would report about 23040 MiB, which the launch defaults also fit, with about 20% less bandwidth",
    ),
    "pending": (
        [gpu(0, 23040, "on", "off")],
        "on",
        "; ECC is to be off after the next reboot, and the reported memory with it",
    ),
    "mixed": (
        [gpu(0, 23040, "on"), gpu(1, 24576, "off")],
        "mixed",
        "ECC differs between the GPUs (GPU 0 on (23040 MiB), GPU 1 off (24576 MiB)): the launch settings follow the "
        "smallest, 23040 MiB; do: set one ECC state on every GPU (nvidia-smi -e, then a reboot)",
    ),
    "hbm": (
        [gpu(0, 32768, "on", name="Tesla V100-SXM2-32GB")],
        "on",
        "ECC on: Tesla V100-SXM2-32GB reports 32768 MiB; its ECC costs no memory (not GDDR)",
    ),
    "none": ([gpu(0, 11264, "", name="NVIDIA GeForce GTX 1080 Ti")], "", ""),
}


@pytest.mark.parametrize("case", sorted(ECC_NOTES))
def test_the_ecc_state_and_its_cost_are_said(case):
    gpus, state, note = ECC_NOTES[case]
    got_state, got_note = RULES.ecc_state(gpus, INBAND)
    assert got_state == state
    if case == "pending":
        assert got_note.endswith(note), got_note
    else:
        assert got_note == note


def test_ecc_is_in_the_published_profile_and_its_state_record():
    facts = ASSESS(report(gpus=[P40_22919]), settings("host", {}))["facts"]
    assert facts["gpu_preflight_profile"]["ecc"] == "on"
    assert facts["gpu_preflight_state_content"]["profile"]["ecc"] == "on"


def test_the_report_shows_the_memory_and_ecc_state_preflight_read():
    """hosts.json keeps preflight's profile; `p40fleet report` reads it into the line and the HTML card."""
    from p40fleet.cli import _record_line
    from p40fleet.fleet import host_record
    from p40fleet.html_report import render_html

    profile = p40_profile(22919, "on")
    saved = {"preflight": {"profile": profile, "has_gpu": True, "gpus": ["Tesla P40"], "driver_version": "418.226.00"}}
    record = host_record("node1", saved)
    assert (record.gpu_memory_mib, record.ecc) == (22919, "on")
    assert "1x Tesla P40 (22919 MiB, ECC on)" in _record_line(record)
    host = {"host": "node1", "status": "converged", "state_source": "gpu_preflight", **record.__dict__}
    page = render_html({"hosts": [host], "totals": {}})
    assert "22919 MiB per GPU" in page and "ECC on" in page
    assert "ECC keeps about 1527 MiB (1/16 of the memory)" in page
