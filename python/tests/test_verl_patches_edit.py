"""owner_scripts/verl_patches_edit.py, without hosts: the edits lineinfile and replace made, in one call.

The role's tests (test_verl_patches.py) hold the module to the real patch sets on the real verl releases, line by
line; these cases pin the two edit kinds' semantics, the fail-closed count check and the restore from pristine
copies on small files.
"""

from __future__ import annotations

import os
import stat

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

edit = load_module(REPO_ROOT / "owner_scripts" / "verl_patches_edit.py", "verl_patches_edit")

AUTOCAST = r"^(\s+with torch\.autocast\(x, )dtype=torch\.bfloat16(\):)$"


def entry(file, module, anchor, replace, count=1, id_="e"):
    return {"id": id_, "file": file, "module": module, "anchor": anchor, "replace": replace, "count": count}


@pytest.fixture
def tree(tmp_path):
    src, state = tmp_path / "src", tmp_path / "state"
    (src / "pkg").mkdir(parents=True)
    (state / "pristine" / "pkg").mkdir(parents=True)
    return src, state


def run(tree, entries, restore=(), check=False, diff=False):
    src, state = tree
    params = edit.options(
        {"source_dir": str(src), "state_dir": str(state), "restore": list(restore), "entries": entries}
    )
    return edit.run(params, check, diff)


@pytest.mark.parametrize(
    ("before", "anchor", "replace", "after"),
    [
        # The matched line becomes the expanded replacement; the rest of the file is untouched.
        (
            "a\n    with torch.autocast(x, dtype=torch.bfloat16):\nb\n",
            AUTOCAST,
            r"\g<1>dtype=torch.float32\g<2>",
            "a\n    with torch.autocast(x, dtype=torch.float32):\nb\n",
        ),
        # A last line without a newline gets one, as lineinfile writes it.
        (
            "a\n    with torch.autocast(x, dtype=torch.bfloat16):",
            AUTOCAST,
            r"\g<1>enabled=False\g<2>",
            "a\n    with torch.autocast(x, enabled=False):\n",
        ),
        # The whole line is replaced, not only the matched part.
        ("keep\nx = bf16  # note\n", "bf16", "x = fp32", "keep\nx = fp32\n"),
    ],
)
def test_a_lineinfile_entry_replaces_the_one_line_it_matches(tree, before, anchor, replace, after):
    src, _ = tree
    (src / "pkg/m.py").write_text(before)
    result = run(tree, [entry("pkg/m.py", "lineinfile", anchor, replace)])
    assert result["changed"] and result["files"] == ["pkg/m.py"]
    assert (src / "pkg/m.py").read_text() == after


def test_a_replace_entry_edits_every_occurrence_and_is_multiline(tree):
    src, _ = tree
    (src / "pkg/m.py").write_text('f(a="fa2")\n  g(a="fa2", b=1)\n')
    anchor = r'^(\s*)(\w)\(a="fa2"'
    run(tree, [entry("pkg/m.py", "replace", anchor, r'\g<1>\g<2>(a="sdpa"', count=2)])
    assert (src / "pkg/m.py").read_text() == 'f(a="sdpa")\n  g(a="sdpa", b=1)\n'


@pytest.mark.parametrize(("module", "count"), [("lineinfile", 1), ("replace", 2)])
def test_a_count_off_fails_before_any_file_is_written(tree, module, count):
    src, _ = tree
    (src / "pkg/a.py").write_text("x = 1\n")
    (src / "pkg/b.py").write_text("y = 1\n")
    entries = [
        entry("pkg/a.py", "replace", "x = 1", "x = 2", id_="first"),
        entry("pkg/b.py", module, "y = 2", "y = 3", count=count, id_="moved"),
    ]
    with pytest.raises(edit.Refused, match=r"moved \(pkg/b.py\): anchor /y = 2/"):
        run(tree, entries)
    assert (src / "pkg/a.py").read_text() == "x = 1\n"


def test_restored_files_start_from_their_pristine_copy_even_without_an_entry(tree):
    src, state = tree
    (src / "pkg/a.py").write_text("x = 2  # edited for another profile\n")
    (src / "pkg/b.py").write_text("y = 9\n")
    (state / "pristine/pkg/a.py").write_text("x = 1\n")
    (state / "pristine/pkg/b.py").write_text("y = 1\n")
    os.chmod(src / "pkg/a.py", 0o640)
    result = run(tree, [entry("pkg/a.py", "lineinfile", r"^x = 1$", "x = 3")], restore=["pkg/b.py", "pkg/a.py"])
    assert (src / "pkg/a.py").read_text() == "x = 3\n"
    assert (src / "pkg/b.py").read_text() == "y = 1\n"
    assert sorted(result["files"]) == ["pkg/a.py", "pkg/b.py"]
    # The checkout's file keeps its mode; no temporary file is left beside it.
    assert stat.S_IMODE(os.stat(src / "pkg/a.py").st_mode) == 0o640
    assert sorted(os.listdir(src / "pkg")) == ["a.py", "b.py"]


def test_a_rerun_on_edited_files_changes_nothing_and_check_mode_only_shows_the_diff(tree):
    src, _ = tree
    (src / "pkg/m.py").write_text("x = 1\n")
    entries = [entry("pkg/m.py", "replace", r"x = 1", "x = 2", count=1)]
    shown = run(tree, entries, check=True, diff=True)
    assert shown["changed"] and (src / "pkg/m.py").read_text() == "x = 1\n"
    assert shown["diff"] == [
        {"before_header": f"{src}/pkg/m.py", "after_header": f"{src}/pkg/m.py", "before": "x = 1\n", "after": "x = 2\n"}
    ]
    assert run(tree, entries)["changed"]
    # Edited: the anchor no longer matches, so the entry refuses rather than edits twice (the role's probe
    # restores from the pristine copy first).
    with pytest.raises(edit.Refused, match="found 0x, expected 1x"):
        run(tree, entries)


@pytest.mark.parametrize(
    ("entries", "restore", "message"),
    [
        ([entry("../etc/x", "replace", "a", "b")], [], "not a plain path"),
        ([entry("/etc/x", "replace", "a", "b")], [], "not a plain path"),
        ([], ["pkg/../../x"], "not a plain path"),
        ([entry("pkg/none.py", "replace", "a", "b")], [], "pkg/none.py: the file is missing"),
        ([], ["pkg/none.py"], "pkg/none.py: its pristine copy is missing"),
        ([entry("pkg/m.py", "sed", "a", "b")], [], "module 'sed' is not one of lineinfile, replace"),
    ],
)
def test_bad_entries_are_refused_naming_them(tree, entries, restore, message):
    src, _ = tree
    (src / "pkg/m.py").write_text("a\n")
    with pytest.raises(edit.Refused, match=message.replace(".", r"\.")):
        run(tree, entries, restore=restore)
    assert (src / "pkg/m.py").read_text() == "a\n"


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="option source_dir must be an absolute path"):
        edit.options({"source_dir": "rel", "state_dir": "/s", "entries": []})
    with pytest.raises(ValueError, match="option entries must be a list"):
        edit.options({"source_dir": "/a", "state_dir": "/s", "entries": "x"})
