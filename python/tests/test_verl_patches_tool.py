"""The verl_patches tool's decisions, table-driven, without Ansible or containers.

Each case lays out a checkout and the role's state directory as a run would have left them (pristine
copies, their manifest, the applied record), changes what the case names, and asserts what `probe`
decides: the action, which files it would restore, and which files it reports as changed since the last
run (the role refuses to touch those: fault case 8, python/tests/faults/cases.py).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_owner_script

TOOL_PATH = REPO_ROOT / "owner_scripts" / "verl_patches_tool.py"
tool = load_owner_script(TOOL_PATH, "verl_patches_tool")

VERSION = "9.9.9"
A = "verl/a.py"  # patched for the dtype group
B = "verl/b.py"  # patched for the attn group only
PRISTINE = {A: "X = torch.bfloat16\n", B: 'ATTN = "flash_attention_2"\n'}
PATCHED = {A: "X = torch.float32\n", B: 'ATTN = "eager"\n'}
PATCH_SET = {
    "id": "verl-9.9.9-r1",
    "verl_version": VERSION,
    "residue": [],
    "entries": [
        {
            "id": "a-dtype",
            "file": A,
            "module": "replace",
            "needs": "dtype",
            "anchor": r"torch\.bfloat16",
            "count": 1,
            "replace": "torch.float32",
            "post": r"torch\.float32",
        },
        {
            "id": "b-attn",
            "file": B,
            "module": "replace",
            "needs": "attn",
            "anchor": "flash_attention_2",
            "count": 1,
            "replace": "eager",
            "post": "eager",
        },
    ],
}
PASCAL = {"name": "pascal", "dtype": "float32", "attn_implementation": "eager", "needs_patches": True}
VOLTA_LIKE = {"name": "dtype-only", "dtype": "float16", "attn_implementation": "sdpa", "needs_patches": True}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def spec_for(root: Path, state: str = "present", active=("dtype", "attn"), profile=PASCAL) -> dict:
    return {
        "source_dir": str(root / "src"),
        "state_dir": str(root / "state"),
        "state": state,
        "version_hint": "",
        "profile": profile,
        "values": {},
        "active": list(active),
        "sets": {VERSION: PATCH_SET},
    }


def lay_out(root: Path, patched_files=(A, B), record_version: str = VERSION, profile=PASCAL) -> dict:
    """The checkout and state as a completed run left them: `patched_files` edited, all covered files kept."""
    src, state = root / "src", root / "state"
    (src / "verl" / "version").mkdir(parents=True)
    (src / "verl" / "version" / "version").write_text(VERSION + "\n")
    for rel, text in PRISTINE.items():
        (src / rel).write_text(PATCHED[rel] if rel in patched_files else text)
        (state / "pristine" / rel).parent.mkdir(parents=True, exist_ok=True)
        (state / "pristine" / rel).write_text(text)
    spec = spec_for(root, active=["dtype", "attn"] if B in patched_files else ["dtype"], profile=profile)
    manifest = {
        "verl_version": VERSION,
        "source_dir": spec["source_dir"],
        "files": {r: digest(t) for r, t in PRISTINE.items()},
    }
    (state / "pristine.json").write_text(json.dumps(manifest))
    patch_set = tool.select(spec, VERSION)
    identity = tool.identity(spec, patch_set, record_version)
    files = {
        rel: {"pristine_sha256": digest(PRISTINE[rel]), "patched_sha256": digest(PATCHED[rel])} for rel in patched_files
    }
    (state / "applied.json").write_text(json.dumps({"identity": identity, "files": files}))
    return spec


def edit(root: Path, rel: str, text: str) -> None:
    (root / "src" / rel).write_text(text)


# case -> (how the host is changed after the last run, the spec the next run uses,
#          expected action, expected restore list, expected changed files as (file, patched?, found))
USER_EDIT = "X = torch.float32  # my own tweak\n"
CASES = {
    "untouched since the last run: converged": (lambda root: None, {}, "none", [], []),
    "a user's edit of a patched file: reported, with all three sums": (
        lambda root: edit(root, A, USER_EDIT),
        {},
        "apply",
        [A, B],
        [(A, digest(PATCHED[A]), digest(USER_EDIT))],
    ),
    "a user's edit, and the run asks for state absent: reported too": (
        lambda root: edit(root, A, USER_EDIT),
        {"state": "absent"},
        "revert",
        [A, B],
        [(A, digest(PATCHED[A]), digest(USER_EDIT))],
    ),
    "a patched file deleted: reported as missing": (
        lambda root: (root / "src" / A).unlink(),
        {},
        "apply",
        [A, B],
        [(A, digest(PATCHED[A]), None)],
    ),
    "new upstream content under the same version: reported": (
        lambda root: edit(root, B, 'ATTN = "flash_attention_2"  # upstream fix\n'),
        {},
        "apply",
        [A, B],
        [(B, digest(PATCHED[B]), digest('ATTN = "flash_attention_2"  # upstream fix\n'))],
    ),
    "a patched file back to its pristine content (a clean reinstall): patched again, nothing reported": (
        lambda root: edit(root, A, PRISTINE[A]),
        {},
        "apply",
        [B],
        [],
    ),
    "an interrupted run (no applied record): redone from the pristine copies, nothing reported": (
        lambda root: ((root / "state" / "applied.json").unlink(), edit(root, A, "X = torch.flo")),
        {},
        "apply",
        [A, B],
        [],
    ),
    "another profile's patches, files as that run left them: re-patched, nothing reported": (
        lambda root: None,
        {"profile": VOLTA_LIKE, "active": ["dtype"]},
        "apply",
        [A, B],
        [],
    ),
    "a pristine copy damaged: the copies are distrusted, nothing reported": (
        lambda root: ((root / "state" / "pristine" / A).write_text("garbage\n"), edit(root, A, USER_EDIT)),
        {},
        "apply",
        [],
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_probe_decides_what_to_restore_and_what_to_refuse(tmp_path, case):
    change, overrides, action, restore, changed = CASES[case]
    spec = lay_out(tmp_path)
    change(tmp_path)
    spec = {**spec, **overrides}
    result = tool.probe(spec)
    assert result["action"] == action
    assert result["restore"] == restore
    expected = [
        {"file": rel, "pristine_sha256": digest(PRISTINE[rel]), "patched_sha256": patched, "found_sha256": found}
        for rel, patched, found in changed
    ]
    assert result["changed_files"] == expected


def test_a_file_the_last_run_left_pristine_is_reported_without_a_patched_sum(tmp_path):
    # The last run patched only A (a dtype-only profile); B kept its pristine copy and must still be pristine.
    spec = lay_out(tmp_path, patched_files=(A,), profile=VOLTA_LIKE)
    edit(tmp_path, B, 'ATTN = "sdpa"  # my own choice\n')
    result = tool.probe({**spec, "profile": PASCAL, "active": ["dtype", "attn"]})
    assert result["changed_files"] == [
        {
            "file": B,
            "pristine_sha256": digest(PRISTINE[B]),
            "patched_sha256": None,
            "found_sha256": digest('ATTN = "sdpa"  # my own choice\n'),
        }
    ]


def test_a_record_of_another_verl_version_reports_nothing(tmp_path):
    # The verl role replaced the checkout by another release: its files are the new baseline.
    spec = lay_out(tmp_path, record_version="9.9.8")
    edit(tmp_path, A, USER_EDIT)
    assert tool.probe(spec)["changed_files"] == []


def test_the_sums_the_probe_reports_are_the_files_real_sha256(tmp_path):
    spec = lay_out(tmp_path)
    edit(tmp_path, A, USER_EDIT)
    [item] = tool.probe(spec)["changed_files"]
    assert item["found_sha256"] == hashlib.sha256((tmp_path / "src" / A).read_bytes()).hexdigest()
    assert item["pristine_sha256"] == hashlib.sha256((tmp_path / "state" / "pristine" / A).read_bytes()).hexdigest()
    shutil.rmtree(tmp_path / "state")
    assert tool.probe(spec)["changed_files"] == []  # no state at all: a first run
