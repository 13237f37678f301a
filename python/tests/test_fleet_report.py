"""`p40fleet report`: what each host now is, built from data (synthetic ansible-runner events shaped
like fleet_state's published contract and gpu_preflight's published state; no containers), as JSON
and as one static HTML page, rendered by headless Chromium into a screenshot people can look at."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import yaml

from p40fleet import api, cli, fleet, html_report
from p40fleet.run import RunResult, _stats_from
from p40fleet.state import StateDir
from tests.pins import CUDA_HOME

from .conftest import TEST_OUTPUT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER_TOO_OLD = (
    "gpu_preflight refused node3 (nothing was changed on it):\n"
    "- driver 470.256.02 is too old for CUDA 11.8; required: >= 520.61.05 (gpu_preflight_driver_min_version); "
    "do: upgrade the driver (e.g. 535 or 550), reboot, then run again\n"
    "- <not html> & nothing else"
)
UNREACHABLE = (
    "Task failed: Failed to connect to the host via ssh: ssh: connect to host 10.88.0.14 port 22: No route to host"
)
REASONS = [
    "profile pascal: 2x Tesla P40, compute capability 6.1 (from nvidia-smi) is within 6.0-6.2",
    "dtype float32: Pascal has no bf16 and no usable fp16 throughput",
    "attention eager: FlashAttention-2 needs sm80+, and SDPA on sm6x in fp32 is untested on a P40",
    "rollout hf: vLLM requires compute capability 7.0+",
    "torch.compile off: Inductor refuses GPUs below compute capability 7.0",
    "launch defaults for >= 22000 MiB per GPU (24576 MiB found)",
]


def preflight(gpus: list[str], driver: str, reasons=REASONS) -> dict:
    return {
        "schema": 1,
        "driver_version": driver,
        "kernel_module": f"proprietary {driver}" if gpus else "",
        "has_gpu": bool(gpus),
        "gpus": gpus,
        "os": "debian 12",
        "profile": {
            "name": "pascal",
            "compute_cap": "6.1",
            "gpu_name": gpus[0] if gpus else "none",
            "gpu_count": len(gpus),
            "reasons": list(reasons),
        },
    }


SITE = "/opt/miniconda3/envs/verl-env/lib/python3.10/site-packages"
FILE = {"uid": 0, "mode": "0644", "sha256": "ab" * 32}


def stages(drift: dict | None = None) -> dict:
    """Findings shaped as plugins/modules/fleet_state_probe.py returns them."""
    drift = drift or {}
    found = {
        # driver_hold's record (plugins/filter/driver_hold.py writes it).
        "driver_hold": {
            "files": {},
            "json": {
                "record": {
                    "schema": 1,
                    "branch": "550",
                    "pinned": ["cuda-drivers-550", "libnvidia-compute", "nvidia-driver", "nvidia-kernel-dkms"],
                    "held": ["cuda-drivers-550"],
                    "held_by_role": ["cuda-drivers-550"],
                    "blacklisted": [],
                }
            },
        },
        "host_prereqs": {"files": {}, "json": {}, "text": {}},
        "cuda_toolkit": {
            "files": {f"{CUDA_HOME}/version.json": FILE, "/usr/local/cuda": None},
            "json": {"version": {"cuda": {"name": "CUDA SDK", "version": "11.8.20220929"}}},
        },
        "cudnn": {"files": {}, "json": {"record": {"prefix": "/usr/local/cudnn-8.9.7-cuda11", "version": "8.9.7"}}},
        "conda_env": {"files": {"/opt/miniconda3/envs/verl-env": {"uid": 1001, "mode": "0755", "dir": True}}},
        "pytorch": {
            "files": {
                f"{SITE}/torch-2.6.0+cu118.dist-info/METADATA": FILE,
                f"{SITE}/triton-3.2.0.dist-info/METADATA": FILE,
            }
        },
        "apex": {
            "files": {f"{SITE}/apex-0.1.dist-info/RECORD": FILE},
            "json": {
                "marker": {
                    "key": "py3.10-torch2.6.0+cu118-cuda11.8-arch6.1-cpp1cuda1-apex810ffae374a2",
                    "built_by": "node2",
                }
            },
        },
        "verl": {
            "files": {f"{SITE}/verl-0.4.1.dist-info/direct_url.json": FILE},
            "text": {"head": "4f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c\n"},
        },
        "verl_patches": {
            "files": {},
            "json": {"record": {"identity": {"patch_set": "verl-0.4.1", "verl_version": "0.4.1"}, "files": {}}},
        },
        "training_data": {"files": {}, "json": {}},
        "launch_script": {"files": {"/home/p40fleet/train_gsm8k_ppo.sh": FILE, "/home/p40fleet/x-compose.py": FILE}},
    }
    return {stage: {"found": value, "drift": list(drift.get(stage, []))} for stage, value in found.items()}


def probe_event(host: str, probe: dict) -> dict:
    return {
        "event": "runner_on_ok",
        "event_data": {
            "host": host,
            "task": "Ensure every stage's markers are read from the host in one probe",
            "role": "fleet_state",
            "res": {**probe, "changed": False, "_ansible_no_log": False},
        },
    }


def preflight_fact_event(host: str, content: dict) -> dict:
    return {
        "event": "runner_on_ok",
        "event_data": {
            "host": host,
            "task": "Ensure the host is probed, judged and its GPU profile published for the later stages",
            "role": "gpu_preflight",
            "res": {"ansible_facts": {"gpu_preflight_state_content": content}, "changed": False},
        },
    }


def failed_event(host: str, message: str, unreachable: bool = False) -> dict:
    return {
        "event": "runner_on_unreachable" if unreachable else "runner_on_failed",
        "event_data": {
            "host": host,
            "task": "Ensure a host that fails preflight is refused before anything touches it",
            "role": "gpu_preflight",
            "res": {"msg": message, "unreachable": unreachable} if unreachable else {"msg": message},
            "ignore_errors": None,
        },
    }


def stats_event(**hosts) -> dict:
    """hosts: name=(ok, changed, failures, unreachable)."""
    data = {"ok": {}, "changed": {}, "failures": {}, "dark": {}, "processed": {}}
    for name, (ok, changed, failures, unreachable) in hosts.items():
        data["processed"][name] = 1
        for key, value in (("ok", ok), ("changed", changed), ("failures", failures), ("dark", unreachable)):
            if value:
                data[key][name] = value
    return {"event": "playbook_on_stats", "event_data": data}


P40X2 = preflight(["Tesla P40", "Tesla P40"], "550.127.05")
RUN_EVENTS = [
    preflight_fact_event("node1", P40X2),
    probe_event(
        "node1",
        {
            "preflight": P40X2,
            "verified": {"preflight_sha256": "cd" * 32, "at": "2026-11-30T10:02:11Z"},
            "reverify": False,
            "stages": stages(),
        },
    ),
    preflight_fact_event("node2", preflight(["Tesla P40"], "535.183.01", REASONS[1:])),
    probe_event(
        "node2",
        {
            "preflight": preflight(["Tesla P40"], "535.183.01", REASONS[1:]),
            "verified": None,
            "reverify": True,
            "stages": stages({"verl_patches": ["verl/utils/torch_dtypes.py differs from patch set verl-0.4.1"]}),
        },
    ),
    failed_event("node3", DRIVER_TOO_OLD),
    failed_event("node4", UNREACHABLE, unreachable=True),
    preflight_fact_event("node5", preflight(["Tesla P40"], "550.127.05", REASONS[1:])),
    stats_event(node1=(92, 0, 0, 0), node2=(88, 3, 0, 0), node3=(3, 0, 1, 0), node4=(0, 0, 0, 1), node5=(9, 0, 0, 0)),
]


def run_result(events: list[dict], run_id: str = "20261130T100211000000Z-ab12") -> RunResult:
    stats = _stats_from(next(e for e in events if e["event"] == "playbook_on_stats")["event_data"])
    from p40fleet.run import failure_from_event

    return RunResult(
        rc=2,
        status="failed",
        stats=stats,
        failures=[f for f in map(failure_from_event, events) if f],
        stdout="",
        artifact_dir=Path(f"/state/runs/{run_id}/artifacts/{run_id}"),
        events=events,
        run_id=run_id,
        started="2026-11-30T10:00:02+00:00",
        finished="2026-11-30T10:02:11+00:00",
    )


def hosts_state_after(events: list[dict], tags: str | None = None) -> dict:
    from p40fleet.report import build_report

    run = run_result(events)
    result = api.ProvisionResult(
        inventory=Path("/fleet/hosts.yml"),
        playbook=Path("/p40fleet/site.yml"),
        exit_code=api.exit_code_for(run),
        status=run.status,
        rc=run.rc,
        run_id=run.run_id,
        tags=tags,
        started=run.started,
        finished=run.finished,
        hosts=api._host_results(run),
        failures=run.failures,
    )
    entry = build_report([("run", result)])["runs"][0]
    return fleet.update_hosts({}, entry, events)


def test_probe_results_are_taken_from_the_event_whose_res_has_stages():
    probes = fleet.probe_results(RUN_EVENTS)
    assert sorted(probes) == ["node1", "node2"]
    assert set(probes["node1"]) == {"preflight", "verified", "reverify", "stages"}
    assert "changed" not in probes["node1"]
    assert sorted(fleet.preflight_results(RUN_EVENTS)) == ["node1", "node2", "node5"]


def test_each_host_gets_a_typed_record_from_the_run():
    records = {r.host: r for r in fleet.host_records(hosts_state_after(RUN_EVENTS), hosts=["node6"])}
    assert {h: r.status for h, r in records.items()} == {
        "node1": "converged",
        "node2": "drift",
        "node3": "failed",
        "node4": "unreachable",
        "node5": "ok",
        "node6": "unknown",
    }
    node1 = records["node1"]
    assert (node1.gpu, node1.gpu_count, node1.driver, node1.profile) == ("2x Tesla P40", 2, "550.127.05", "pascal")
    assert node1.profile_reasons == REASONS
    assert (node1.cuda, node1.cudnn, node1.torch, node1.apex, node1.verl) == (
        "11.8.20220929",
        "8.9.7",
        "2.6.0+cu118",
        "0.1",
        "0.4.1",
    )
    # Which host built the installed Apex wheel, as the controller recorded it.
    assert (node1.apex_key, node1.apex_built_by) == (
        "py3.10-torch2.6.0+cu118-cuda11.8-arch6.1-cpp1cuda1-apex810ffae374a2",
        "node2",
    )
    assert (node1.patch_set, node1.patch_state) == ("verl-0.4.1", "patched")
    assert node1.launch_script == "/home/p40fleet/train_gsm8k_ppo.sh"
    assert (node1.kernel_module, node1.driver_hold, node1.driver_on_hold) == (
        "proprietary 550.127.05",
        "R550 held",
        ["cuda-drivers-550"],
    )
    assert node1.driver_pinned == ["cuda-drivers-550", "libnvidia-compute", "nvidia-driver", "nvidia-kernel-dkms"]
    assert (node1.verified_at, node1.state_source) == ("2026-11-30T10:02:11Z", "fleet_state probe")
    assert node1.last_run.state == "ok" and node1.last_run.stats["ok"] == 92 and node1.first_failure is None
    assert records["node2"].drift == {"verl_patches": ["verl/utils/torch_dtypes.py differs from patch set verl-0.4.1"]}
    node3 = records["node3"]
    assert node3.first_failure.message == DRIVER_TOO_OLD  # verbatim, every line
    assert node3.first_failure.role == "gpu_preflight" and node3.gpu is None
    assert records["node4"].first_failure.unreachable
    node5 = records["node5"]
    assert (node5.state_source, node5.gpu, node5.cuda) == ("gpu_preflight", "1x Tesla P40", None)


def test_a_later_run_keeps_what_earlier_runs_learned_and_a_refresh_is_not_a_run():
    state = hosts_state_after(RUN_EVENTS)
    # A second run limited to node3, after its driver upgrade: node3 now passes preflight.
    upgraded = preflight(["Tesla P40"], "550.127.05", REASONS[1:])
    later = [preflight_fact_event("node3", upgraded), stats_event(node3=(9, 1, 0, 0))]
    run = run_result(later, run_id="20261130T110000000000Z-cd34")
    entry = {"run_id": run.run_id, "label": "run", "finished": "2026-11-30T11:00:00+00:00", "hosts": {}}
    entry["hosts"]["node3"] = {"state": "changed", "stats": run.stats["node3"], "failures": []}
    state = fleet.update_hosts(state, entry, later)
    records = {r.host: r for r in fleet.host_records(state)}
    assert records["node3"].status == "ok" and records["node3"].first_failure is None
    assert records["node3"].driver == "550.127.05"
    assert records["node1"].status == "converged"  # untouched by a run it was not in

    # A state refresh reads node1 again but cannot reach node2: neither last run changes.
    refresh = [
        probe_event("node1", {"preflight": P40X2, "verified": None, "reverify": True, "stages": stages()}),
        failed_event("node2", UNREACHABLE, unreachable=True),
    ]
    entry = {
        "run_id": "r-refresh",
        "finished": "2026-11-30T12:00:00+00:00",
        "hosts": {
            "node1": {"state": "ok", "stats": {}, "failures": []},
            "node2": {"state": "unreachable", "stats": {}, "failures": [{"message": UNREACHABLE}]},
        },
    }
    state = fleet.update_hosts(state, entry, refresh, provisioning=False)
    records = {r.host: r for r in fleet.host_records(state)}
    assert records["node1"].last_run.run_id == "20261130T100211000000Z-ab12"
    assert records["node1"].state_at == "2026-11-30T12:00:00+00:00" and records["node1"].verified_at is None
    assert records["node2"].status == "unreachable" and UNREACHABLE in records["node2"].probe_error


def _png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def screenshot(page: Path, png: Path, width: int = 1400, height: int = 1700) -> Path:
    """Headless Chromium, offline: any http(s) fetch would go to a proxy that is not there."""
    png.unlink(missing_ok=True)
    result = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--proxy-server=http://127.0.0.1:9",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and png.is_file(), result.stderr[-2000:]
    return png


def test_json_and_html_report_from_a_state_directory(tmp_path, capsys):
    inventory = tmp_path / "hosts.yml"
    hosts = {f"node{i}": {"ansible_host": "127.0.0.1", "ansible_port": 9} for i in range(1, 7)}
    inventory.write_text(yaml.safe_dump({"all": {"children": {"p40-hosts": {"hosts": hosts}}}}))
    state = StateDir(tmp_path / "state")
    state.inventory(inventory).write_hosts(hosts_state_after(RUN_EVENTS))
    out = TEST_OUTPUT
    out.mkdir(parents=True, exist_ok=True)
    json_path, html_path = out / "report.json", out / "report.html"
    argv = ["report", "-i", str(inventory), "--state-dir", str(tmp_path / "state")]
    code = cli.main([*argv, "--json", str(json_path), "--html", str(html_path)])
    assert code == cli.EXIT_OK

    data = json.loads(json_path.read_text())
    assert data["schema"] == fleet.FLEET_REPORT_SCHEMA
    assert data["totals"] == {
        "hosts": 6,
        "converged": 1,
        "ok": 1,
        "drift": 1,
        "failed": 1,
        "unreachable": 1,
        "interrupted": 0,
        "unknown": 1,
    }
    by_host = {h["host"]: h for h in data["hosts"]}
    assert by_host["node3"]["first_failure"]["message"] == DRIVER_TOO_OLD
    assert by_host["node1"]["profile_reasons"] == REASONS

    page = html_path.read_text()
    # One file, nothing fetched: no scripts, no external stylesheets, images or fonts.
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", page)
    assert "<pre>gpu_preflight refused node3 (nothing was changed on it):\n- driver 470.256.02" in page
    assert "- &lt;not html&gt; &amp; nothing else</pre>" in page
    for reason in REASONS:
        assert html_report.escape(reason) in page
    for text in ("2.6.0+cu118", "8.9.7", "verl-0.4.1", "/home/p40fleet/train_gsm8k_ppo.sh", "drift"):
        assert text in page
    assert "driver 550.127.05 · proprietary 550.127.05 module · R550 held" in page
    assert (
        "<h3>driver hold</h3>R550 held: pinned cuda-drivers-550, libnvidia-compute, nvidia-driver, "
        "nvidia-kernel-dkms; on hold: cuda-drivers-550</div>"
    ) in page
    # Hosts that need attention come first.
    order = [page.index(f'id="host-{h}"') for h in ("node3", "node4", "node2", "node6", "node5", "node1")]
    assert order == sorted(order)

    printed = capsys.readouterr().err
    assert "node3: first failure: Ensure a host that fails preflight" in printed
    assert re.search(
        r"node1: converged · 2x Tesla P40 · driver 550.127.05 \(proprietary 550.127.05 module, R550 held\) · "
        r"profile pascal · CUDA 11.8",
        printed,
    )

    if CHROMIUM is None:
        pytest.skip("chromium is not installed: run `make test-deps`")
    png = screenshot(html_path, out / "report.png")
    width, height = _png_size(png)
    assert (width, height) == (1400, 1700)
    assert png.stat().st_size > 50_000  # a page with content, not a blank one
    print(f"screenshot: {png}")


def test_refresh_runs_the_state_playbook_and_keeps_each_probe(tmp_path, monkeypatch):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  hosts:\n    node1: {ansible_host: 127.0.0.1, ansible_port: 9}\n    node2: {}\n")
    playbook = tmp_path / "state.yml"
    playbook.write_text("- hosts: all\n  gather_facts: false\n  tasks: []\n")
    monkeypatch.setattr(api, "STATE_PLAYBOOK", playbook)
    seen = {}

    def fake_run(playbook_path, inventory_path, **kwargs):
        seen["playbook"] = Path(playbook_path)
        events = [
            probe_event("node1", {"preflight": P40X2, "verified": None, "reverify": True, "stages": stages()}),
            failed_event("node2", UNREACHABLE, unreachable=True),
            stats_event(node1=(2, 0, 0, 0), node2=(0, 0, 0, 1)),
        ]
        return run_result(events)

    monkeypatch.setattr(api, "run_playbook", fake_run)
    state_dir = tmp_path / "state"
    code = cli.main(["report", "-i", str(inventory), "--state-dir", str(state_dir), "--refresh"])
    assert code == cli.EXIT_HOSTS_UNREACHABLE
    assert seen["playbook"] == playbook
    saved = StateDir(state_dir).inventory(inventory).read_hosts()["hosts"]
    assert (
        f"{SITE}/torch-2.6.0+cu118.dist-info/METADATA" in saved["node1"]["probe"]["stages"]["pytorch"]["found"]["files"]
    )
    assert "last_run" not in saved["node1"]  # a refresh reads, it is no run of the playbook
    assert saved["node2"]["probe_error"]["state"] == "unreachable"
    assert StateDir(state_dir).inventory(inventory).read_last_report() is None


HOSTILE = '"><script>alert(document.cookie)</script><b x="'


def test_host_supplied_text_is_escaped_and_markers_that_are_no_mapping_do_not_crash():
    # A regression: a host's verified.json said what verified_at is, printed unescaped; a list where a marker's JSON
    # object belongs crashed `p40fleet report`.
    found = stages()
    found["apex"]["found"]["json"]["marker"] = ["not", "a", "mapping"]
    found["cudnn"]["found"]["json"]["record"] = "a string"
    found["cuda_toolkit"]["found"]["json"]["version"] = [1, 2]
    found["verl_patches"]["found"]["json"]["record"] = {"identity": 42}
    found["verl"]["found"]["text"]["head"] = 12345
    saved = {
        "probe": {"stages": found, "verified": {"at": HOSTILE}, "preflight": {"driver_version": HOSTILE}},
        "probed_at": HOSTILE,
    }
    record = fleet.host_record("node1", saved)
    assert (record.apex, record.cudnn, record.cuda, record.patch_set) == ("0.1", None, None, None)
    assert record.verified_at == HOSTILE
    page = html_report.render_html(fleet.fleet_report([record], "inventory/hosts.yml"))
    assert "<script>" not in page and 'x="' not in page
    assert "&quot;&gt;&lt;script&gt;alert(document.cookie)&lt;/script&gt;" in page
    # Not even a non-string, non-dict verified record breaks it.
    saved["probe"]["verified"] = ["x"]
    assert fleet.host_record("node1", saved).verified_at is None
