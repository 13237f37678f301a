"""plugins/modules/cudnn_links.py, without hosts: cuDNN's links into the CUDA tree made and stale ones removed in
one call, as the two file-module loops it replaced did (test_cudnn.py runs the role on sandbox hosts)."""

from __future__ import annotations

import os

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

links = load_module(REPO_ROOT / "plugins" / "modules" / "cudnn_links.py", "cudnn_links")


@pytest.fixture
def trees(tmp_path):
    prefix, cuda = tmp_path / "cudnn", tmp_path / "cuda"
    for directory in (prefix / "include", prefix / "lib", cuda / "include", cuda / "lib64"):
        directory.mkdir(parents=True)
    for name in ("include/cudnn.h", "include/cudnn_version.h", "lib/libcudnn.so.8.9.7"):
        (prefix / name).write_text(name)
    os.symlink("libcudnn.so.8.9.7", prefix / "lib" / "libcudnn.so.8")
    return prefix, cuda


def wanted(prefix, cuda):
    return [
        {"src": str(prefix / "include/cudnn.h"), "dest": str(cuda / "include/cudnn.h")},
        {"src": str(prefix / "include/cudnn_version.h"), "dest": str(cuda / "include/cudnn_version.h")},
        {"src": str(prefix / "lib/libcudnn.so.8"), "dest": str(cuda / "lib64/libcudnn.so.8")},
    ]


def act(check_mode=False, **arguments):
    return links.run(links.options(arguments), check_mode)


def test_links_are_made_then_a_rerun_changes_nothing(trees):
    prefix, cuda = trees
    result = act(links=wanted(prefix, cuda))
    assert result["changed"] and len(result["linked"]) == 3
    for item in wanted(prefix, cuda):
        assert os.readlink(item["dest"]) == item["src"]
    assert (cuda / "lib64/libcudnn.so.8").read_text() == "lib/libcudnn.so.8.9.7"
    assert act(links=wanted(prefix, cuda)) == {"changed": False, "removed": [], "linked": []}
    assert sorted(os.listdir(cuda / "include")) == ["cudnn.h", "cudnn_version.h"]


def test_a_link_to_another_cudnn_or_a_copied_file_is_replaced_and_stale_links_go(trees, tmp_path):
    prefix, cuda = trees
    os.symlink(tmp_path / "old/include/cudnn.h", cuda / "include/cudnn.h")
    (cuda / "include/cudnn_version.h").write_text("a copy, not a link")
    os.symlink(tmp_path / "old/lib/libcudnn_ops_infer.so.8", cuda / "lib64/libcudnn_ops_infer.so.8")
    result = act(links=wanted(prefix, cuda), remove=[str(cuda / "lib64/libcudnn_ops_infer.so.8")])
    assert result["removed"] == [str(cuda / "lib64/libcudnn_ops_infer.so.8")]
    assert len(result["linked"]) == 3
    assert os.readlink(cuda / "include/cudnn_version.h") == str(prefix / "include/cudnn_version.h")
    assert sorted(os.listdir(cuda / "lib64")) == ["libcudnn.so.8"]


def test_check_mode_reports_and_changes_nothing(trees):
    prefix, cuda = trees
    os.symlink("/elsewhere", cuda / "lib64/libcudnn_old.so")
    result = act(check_mode=True, links=wanted(prefix, cuda), remove=[str(cuda / "lib64/libcudnn_old.so")])
    assert result["changed"] and len(result["linked"]) == 3 and len(result["removed"]) == 1
    assert os.listdir(cuda / "include") == [] and os.listdir(cuda / "lib64") == ["libcudnn_old.so"]


def test_what_is_not_what_the_probe_saw_is_refused_and_left(trees):
    prefix, cuda = trees
    (cuda / "lib64/libcudnn_stale.so").write_text("a file now, not the link the probe listed")
    with pytest.raises(links.Refused, match=r"libcudnn_stale\.so is no longer a link"):
        act(remove=[str(cuda / "lib64/libcudnn_stale.so")])
    assert (cuda / "lib64/libcudnn_stale.so").read_text().startswith("a file now")
    (cuda / "include/cudnn.h").mkdir()
    with pytest.raises(links.Refused, match=r"cudnn\.h is a directory"):
        act(links=wanted(prefix, cuda)[:1])
    assert (cuda / "include/cudnn.h").is_dir()
    # A path already gone is nothing to remove.
    assert act(remove=[str(cuda / "lib64/libcudnn_gone.so")])["removed"] == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"links": [{"src": "rel", "dest": "/x"}]}, "a link's src must be an absolute path"),
        ({"links": [{"src": "/x"}]}, "a link's dest must be an absolute path"),
        ({"links": "x"}, "option links must be a list"),
        ({"remove": ["rel"]}, "a path to remove must be an absolute path"),
    ],
)
def test_bad_options_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        links.options(arguments)
