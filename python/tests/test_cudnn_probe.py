"""plugins/modules/cudnn_probe.py, without hosts: what the cudnn role's probe reads of a prefix and a CUDA tree, run
through AnsibleModule as Ansible runs it (test_cudnn.py runs the role on sandbox hosts), and what it hands the
links module (test_cudnn_links.py)."""

from __future__ import annotations

import json
import os

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main

probe = load_module(REPO_ROOT / "plugins" / "modules" / "cudnn_probe.py", "cudnn_probe")
HEADER = "#define CUDNN_MAJOR 8\n#define CUDNN_MINOR 9\n#define CUDNN_PATCHLEVEL 7\n"


@pytest.fixture
def trees(tmp_path):
    prefix, cuda = tmp_path / "cudnn", tmp_path / "cuda"
    for directory in (prefix / "include", prefix / "lib", cuda / "include", cuda / "lib64"):
        directory.mkdir(parents=True)
    (prefix / "include" / "cudnn_version.h").write_text(HEADER)
    (prefix / "lib" / "libcudnn.so.8.9.7").write_text("so")
    os.symlink("libcudnn.so.8.9.7", prefix / "lib" / "libcudnn.so.8")
    return prefix, cuda


def found(prefix, cuda, tmp_path, link_into_cuda=True):
    arguments = {
        "prefix": str(prefix),
        "cuda_home": str(cuda),
        "link_into_cuda": link_into_cuda,
        "state_file": str(tmp_path / "cudnn.json"),
    }
    result = run_module_main(probe, arguments)
    assert (result["rc"], result["changed"]) == (0, False), result
    return result["found"]


def test_a_complete_prefix_is_read_with_the_links_it_still_needs(trees, tmp_path):
    prefix, cuda = trees
    state = found(prefix, cuda, tmp_path)
    assert (state["prefix_version"], state["prefix_symlinks_ok"]) == ("8.9.7", True)
    assert {link["dest"] for link in state["links_missing"]} == {
        str(cuda / "include" / "cudnn_version.h"),
        str(cuda / "lib64" / "libcudnn.so.8"),
        str(cuda / "lib64" / "libcudnn.so.8.9.7"),
    }
    assert (state["links_stale"], state["foreign_files"], state["recorded"], state["old_prefix"]) == (
        [],
        [],
        None,
        None,
    )


def test_a_copy_that_lost_its_symlink_and_another_cudnn_s_names_are_found(trees, tmp_path):
    prefix, cuda = trees
    (prefix / "lib" / "libcudnn.so.8").unlink()
    (prefix / "lib" / "libcudnn.so.8").write_text("a copy, not a link")
    os.symlink("/opt/cudnn-8.6/lib/libcudnn_ops.so", cuda / "lib64" / "libcudnn_ops.so")
    (cuda / "include" / "cudnn_backend.h").write_text("someone's file")
    state = found(prefix, cuda, tmp_path)
    assert state["prefix_symlinks_ok"] is False
    assert state["links_stale"] == [str(cuda / "lib64" / "libcudnn_ops.so")]
    assert state["foreign_files"] == [str(cuda / "include" / "cudnn_backend.h")]


def test_links_are_not_read_when_not_wanted_and_an_old_prefix_is_named_from_the_record(trees, tmp_path):
    prefix, cuda = trees
    old = tmp_path / "cudnn-8.6"
    old.mkdir()
    (tmp_path / "cudnn.json").write_text(json.dumps({"prefix": str(old)}))
    state = found(prefix, cuda, tmp_path, link_into_cuda=False)
    assert state["links_missing"] == [] and state["old_prefix"] == str(old)
    assert state["recorded"] == {"prefix": str(old)}


@pytest.mark.parametrize("record", ["not json", "[1, 2]"])
def test_an_unreadable_or_odd_record_counts_as_none_or_names_no_prefix(trees, tmp_path, record):
    prefix, cuda = trees
    (tmp_path / "cudnn.json").write_text(record)
    assert found(prefix, cuda, tmp_path)["old_prefix"] is None


def test_a_missing_prefix_has_no_version_and_a_missing_option_fails(tmp_path):
    state = found(tmp_path / "none", tmp_path / "cuda", tmp_path)
    assert (state["prefix_exists"], state["prefix_version"], state["prefix_symlinks_ok"]) == (False, None, False)
    result = run_module_main(probe, {"prefix": str(tmp_path)})
    assert result["rc"] == 1 and "missing required arguments" in result["msg"]
