"""The two probes that run on every host on every run, built by Ansible's own module builder and run as it runs them.

Both are plain scripts in Ansible's JSON-arguments style (no module library to unpack on the host). This checks
that Ansible still builds them that way, that arguments survive the substitution into the script whatever they
hold (quotes, triple quotes, backslashes, non-ASCII, newlines), and that a bad option fails with a message.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.executor.module_common import modify_module
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar

REPO_ROOT = Path(__file__).resolve().parents[2]
FLEET_STATE_PROBE = REPO_ROOT / "plugins" / "modules" / "fleet_state_probe.py"
GPU_PREFLIGHT_PROBE = REPO_ROOT / "plugins" / "modules" / "gpu_preflight_probe.py"
AWKWARD = 'it\'s "quoted", \'\'\'triple\'\'\' and """triple""", C:\\new\\table \\\\ \u00e9\nsecond line'


def run_module(path: Path, args: dict, check_mode: bool = False) -> tuple[int, dict]:
    built = modify_module(
        module_name=path.stem,
        module_path=str(path),
        module_args={**args, "_ansible_check_mode": check_mode},
        templar=Templar(loader=DataLoader()),
        task_vars={"ansible_python_interpreter": sys.executable},
    )
    assert built.module_style == "new"
    # The JSON-arguments style: the script itself, not an AnsiballZ bundle of Ansible's module library.
    assert b'\nARGUMENTS = r"""{"' in built.b_module_data and b"ANSIBALLZ" not in built.b_module_data.upper()
    done = subprocess.run([sys.executable, "-"], input=built.b_module_data, capture_output=True, check=False)
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def stage(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "version.json").write_text('{"cuda": {"version": "11.8.20220929"}}')
    spec = {
        "inputs": {"cuda_toolkit_note": AWKWARD, "role_code_sha256": "abc"},
        "files": [str(tmp_path / "home" / "version.json")],
        "json": {"version": str(tmp_path / "home" / "version.json")},
    }
    return tmp_path, {"cuda_toolkit": spec}


def test_the_state_probe_reads_records_and_converges_with_awkward_inputs(stage):
    root, stages = stage
    common = {"state_dir": str(root / "state"), "stages": stages, "host": "node1"}
    rc, first = run_module(FLEET_STATE_PROBE, common)
    assert (rc, first["gates"], first["converged"]) == (0, {"cuda_toolkit": "converge"}, False)
    assert first["stages"]["cuda_toolkit"]["found"]["json"]["version"] == {"cuda": {"version": "11.8.20220929"}}
    rc, dry = run_module(FLEET_STATE_PROBE, {**common, "mode": "record", "stage": "cuda_toolkit"}, check_mode=True)
    assert (rc, dry["recorded"], (root / "state").exists()) == (0, True, False)
    rc, recorded = run_module(FLEET_STATE_PROBE, {**common, "mode": "record", "stage": "cuda_toolkit"})
    assert (rc, recorded["recorded"]) == (0, True)
    record_file = root / "state" / "stages" / "cuda_toolkit.json"
    record = json.loads(record_file.read_text())
    # A digest of each input, never the value, in a file root alone reads.
    assert "inputs" not in record and AWKWARD not in record_file.read_text()
    assert record["input_sha256"]["cuda_toolkit_note"] == hashlib.sha256(json.dumps(AWKWARD).encode()).hexdigest()
    assert record_file.stat().st_mode & 0o777 == 0o600
    rc, again = run_module(FLEET_STATE_PROBE, common)
    assert (rc, again["gates"], again["converged"], "warnings" in again) == (0, {"cuda_toolkit": "none"}, True, False)


def test_the_state_probe_names_the_host_it_re_verifies(tmp_path):
    preflight = {"driver_version": "550.127.05", "gpus": ["Tesla P40"]}
    args = {"state_dir": str(tmp_path / "state"), "stages": {}, "preflight_state": preflight, "host": "node7"}
    rc, result = run_module(FLEET_STATE_PROBE, args)
    assert (rc, result["reverify"], result["converged"]) == (0, True, False)
    assert result["warnings"] == [
        "node7: the preflight state changed since the stack was last verified (never verified -> 550.127.05): "
        "re-verifying every stage"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"state_dir": "/x", "stagse": {}}, "unsupported option(s) stagse; supported: mode, state_dir"),
        ({"stages": {}}, "state_dir (a path) is required"),
        ({"state_dir": "/x", "mode": "erase"}, "mode must be one of probe, record, verified, got 'erase'"),
        ({"state_dir": "/x", "mode": "record", "stage": "cudnn"}, "no markers given for stage cudnn"),
        ({"state_dir": "/x", "mode": "verified"}, "mode verified needs preflight_state"),
        ({"state_dir": "/x", "run_tags": "all"}, "run_tags must be a list, got 'all'"),
        ({"state_dir": "/x", "packages": ["git", 1]}, "packages must be a list of strings, got ['git', 1]"),
    ],
)
def test_the_state_probe_refuses_bad_options(args, message):
    rc, result = run_module(FLEET_STATE_PROBE, args)
    assert (rc, result["failed"]) == (1, True)
    assert result["msg"].startswith("fleet_state_probe: " + message), result["msg"]


def test_the_preflight_probe_reports_a_host_without_nvidia_smi(tmp_path):
    args = {"nvidia_smi": str(tmp_path / "no-such-nvidia-smi"), "paths": [str(tmp_path)], "state_file": AWKWARD}
    rc, result = run_module(GPU_PREFLIGHT_PROBE, args)
    report = result["report"]
    assert (rc, result["changed"], report["nvidia_smi"]["path"], report["state"]["exists"]) == (0, False, "", False)
    assert [disk["path"] for disk in report["disks"]] == [str(tmp_path)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"state_file": "/x", "nvidia-smi": "x"}, "unsupported option(s) nvidia-smi"),
        ({"paths": []}, "state_file (a path) is required, got None"),
        ({"state_file": "/x", "paths": "/"}, "paths must be a list of paths, got '/'"),
    ],
)
def test_the_preflight_probe_refuses_bad_options(args, message):
    rc, result = run_module(GPU_PREFLIGHT_PROBE, args)
    assert (rc, result["failed"]) == (1, True)
    assert result["msg"].startswith("gpu_preflight_probe: " + message), result["msg"]
