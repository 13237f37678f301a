"""cuda_toolkit's classification of what sits at the install path, without containers (plugins/filter/cuda_toolkit.py).

The findings are the shape plugins/modules/cuda_toolkit_probe.py returns; each situation is paired with
its verdict. The sandbox tests (test_cuda_toolkit.py) prove the wiring on hosts.
"""

from __future__ import annotations

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.pins import CUDA_HOME
from tests.source_modules import load_module

CLASSIFY = load_module(
    REPO_ROOT / "plugins" / "filter" / "cuda_toolkit.py", "cuda_toolkit_filter"
).cuda_toolkit_classify
WHOLE = {"home_exists": True, "version_json": "11.8.89", "nvcc_release": "11.8", "libcudart": True, "marker": None}

CASES = {
    "installed": (WHOLE, "installed"),
    "nothing_there": (
        {**WHOLE, "home_exists": False, "version_json": None, "nvcc_release": None, "libcudart": False},
        "absent",
    ),
    # Another release at our path is someone else's toolkit: never deleted.
    "another_release": ({**WHOLE, "version_json": "12.1.105", "nvcc_release": "12.1"}, "foreign"),
    "a_release_that_only_starts_alike": ({**WHOLE, "version_json": "11.80.1"}, "foreign"),
    # An attempt left unfinished, whatever the files say.
    "marker_left": ({**WHOLE, "marker": {"default_link": None, "home": CUDA_HOME}}, "partial"),
    "no_libcudart": ({**WHOLE, "libcudart": False}, "partial"),
    "nvcc_missing": ({**WHOLE, "nvcc_release": None}, "partial"),
    "version_json_missing": ({**WHOLE, "version_json": None}, "partial"),
    "version_json_without_a_patch_number": ({**WHOLE, "version_json": "11.8"}, "partial"),
    # A probe that did not report the marker at all is not taken for "no marker".
    "marker_not_reported": ({k: v for k, v in WHOLE.items() if k != "marker"}, "partial"),
}


@pytest.mark.parametrize("situation", sorted(CASES))
def test_each_situation_gets_its_verdict(situation):
    found, verdict = CASES[situation]
    assert CLASSIFY(found, "11.8") == verdict


def test_the_role_wires_the_filter():
    converge = (REPO_ROOT / "roles" / "cuda_toolkit" / "tasks" / "probe.yml").read_text()
    assert "cuda_toolkit_found | p40fleet.fleet.cuda_toolkit_classify(cuda_toolkit_version)" in converge
