"""plugins/modules/cuda_toolkit_probe.py, without hosts, run through AnsibleModule as Ansible runs it: what it reads of
a toolkit, the default link and its marker, free space and the directories root executes from. The verdicts on
what it finds are the filter's (test_cuda_toolkit_rules.py); test_cuda_toolkit.py runs the role on sandbox hosts."""

from __future__ import annotations

import json
import os

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main

probe = load_module(REPO_ROOT / "plugins" / "modules" / "cuda_toolkit_probe.py", "cuda_toolkit_probe")


def found(tmp_path, **options):
    arguments = {
        "home": str(tmp_path / "cuda-11.8"),
        "link_path": str(tmp_path / "cuda"),
        "marker": str(tmp_path / "marker.installing"),
        **options,
    }
    result = run_module_main(probe, arguments)
    assert (result["rc"], result["changed"]) == (0, False), result
    return result["found"]


def test_a_toolkit_s_version_file_and_runtime_are_read_and_a_missing_one_says_why(tmp_path):
    absent = found(tmp_path)
    assert (absent["home_exists"], absent["version_json"], absent["libcudart"]) == (False, None, False)
    assert "No such file" in absent["version_json_error"]
    home = tmp_path / "cuda-11.8"
    (home / "lib64").mkdir(parents=True)
    (home / "version.json").write_text(json.dumps({"cuda": {"version": "11.8.20220929"}}))
    (home / "lib64" / "libcudart.so").write_text("so")
    state = found(tmp_path)
    assert (state["home_exists"], state["version_json"], state["libcudart"], state["nvcc_release"]) == (
        True,
        "11.8.20220929",
        True,
        None,
    )


def test_an_interrupted_run_s_marker_keeps_the_link_as_it_was_before(tmp_path):
    os.symlink("/usr/local/cuda-12.4", tmp_path / "cuda")
    state = found(tmp_path)
    assert state["default_link"] == state["original_link"] == {"state": "link", "target": "/usr/local/cuda-12.4"}
    before = {"state": "link", "target": "/usr/local/cuda-12.2"}
    (tmp_path / "marker.installing").write_text(json.dumps({"default_link": before}))
    state = found(tmp_path)
    assert (state["marker"], state["original_link"]) == ({"default_link": before}, before)
    (tmp_path / "marker.installing").write_text("[not, a, record")
    assert found(tmp_path)["original_link"] == state["default_link"]


def test_paths_on_one_file_system_are_summed_against_its_free_space(tmp_path):
    room = found(tmp_path, room=[[str(tmp_path / "a" / "b"), "100"], [str(tmp_path), 28]])["room"]
    assert len(room) == 1 and room[0]["need_mib"] == 128 and room[0]["anchor"] == str(tmp_path)
    assert room[0]["avail_mib"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_directory_another_account_owns_or_can_write_is_named(tmp_path):
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4321, 4321)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    os.chmod(tmp_path, 0o755)
    problems = found(tmp_path, private_dirs=[str(ours), str(theirs), str(loose / "inner")])["private_dir_problems"]
    assert f"{theirs} is owned by uid 4321, not root" in problems
    assert any(p.startswith(f"{loose} is writable by group or others") for p in problems)
    assert not any(str(ours) in p for p in problems)
