"""Cases 7 and 8 on node1, a host site.yml converged: verl_patches fails closed and never overwrites an edit.

Case 8 (new behaviour): a patched file edited on the host since the last run (as its owner would) is refused,
naming the file and its pristine, patched and found sha256, and nothing in the checkout or the role's state
changes, whether the run wants the patches present or absent; once the file is put back, the next run
converges. Case 7: on the checkout as verl ships it (no patch state yet), a file edited so an anchor moved, and
a checkout that says it is a release without a patch set, fail before the first edit, the files as they were.
(test_verl_patches_tool.py decides case 8 without containers; test_verl_patches.py runs both cases on the real
verl sdists over a local connection and the unsupported release on a sandbox host.)
"""

from __future__ import annotations

import json

import pytest
import yaml
from tests.test_verl_patches import changed_file_message

from p40fleet_dev.paths import REPO_ROOT

pytestmark = pytest.mark.sandbox

HOST = "node1"
VERL = "/opt/p40fleet/verl"  # verl_checkout_dir
STATE = "/var/lib/p40fleet/verl_patches"  # verl_patches_state_dir
OWNER = "p40fleet"
ACTOR = "verl/workers/actor/dp_actor.py"
PATCH_SET = yaml.safe_load((REPO_ROOT / "roles/verl_patches/vars/main/patchsets/verl-0.4.1.yml").read_text())


def tree(fleet, root: str) -> dict[str, str]:
    """Every file under root (the .git directory aside) and its sha256, read on the host."""
    listing = fleet.sh(
        HOST, f"cd {root} && find . -path ./.git -prune -o -type f -print0 | sort -z | xargs -0 -r sha256sum"
    )
    return {line[66:]: line[:64] for line in listing.splitlines()}


def messages(result) -> list[str]:
    return [f.message for f in result.failures]


@pytest.mark.fault_case(8)
def test_a_patched_file_edited_on_the_host_is_refused_and_kept_as_it_is(converged_node1):
    fleet = converged_node1
    record = json.loads(fleet.sh(HOST, f"cat {STATE}/applied.json"))["files"][ACTOR]
    fleet.sh(HOST, f"printf '\\n# my own change, to keep\\n' >> {VERL}/{ACTOR}", user=OWNER)
    found = fleet.sh(HOST, f"sha256sum {VERL}/{ACTOR}").split()[0]
    checkout, state = tree(fleet, VERL), tree(fleet, STATE)
    for extra, action in (({}, "patching"), ({"verl_patches_state": "absent"}, "restoring")):
        result = fleet.play(HOST, stages=("verl_patches",), extra_vars=extra)
        assert messages(result) == [
            changed_file_message(
                HOST, VERL, STATE, action, [(ACTOR, record["pristine_sha256"], record["patched_sha256"], found)]
            )
        ]
        assert result.stats[HOST]["changed"] == 0
        assert tree(fleet, VERL) == checkout
        assert tree(fleet, STATE) == state
    # The whole pipeline stops there for this host too, and the file stays as its owner left it.
    site = fleet.play(HOST)
    assert [f.role for f in site.failures] == ["verl_patches"]
    assert tree(fleet, VERL) == checkout

    # Put back as verl ships it (the role's pristine copy): the next run patches it again and converges.
    fleet.sh(HOST, f"cat {STATE}/pristine/{ACTOR} > {VERL}/{ACTOR}", user="root")
    fleet.converge(HOST)
    assert fleet.sh(HOST, f"sha256sum {VERL}/{ACTOR}").split()[0] == record["patched_sha256"]
    assert fleet.sh(HOST, f"stat -c %U {VERL}/{ACTOR}") == OWNER


@pytest.mark.fault_case(7)
@pytest.mark.faults_full
def test_a_moved_anchor_or_a_release_without_a_patch_set_fails_closed_on_the_host(converged_node1):
    fleet = converged_node1
    # The checkout as verl ships it and no state of the role: where a first patching starts.
    reverted = fleet.play(HOST, stages=("verl_patches",), extra_vars={"verl_patches_state": "absent"})
    assert reverted.rc == 0, messages(reverted)
    assert fleet.sh(HOST, f"ls -A {STATE}") == ""
    assert fleet.sh(HOST, f"git -C {VERL} status --porcelain", user=OWNER) == ""

    # An anchor moved: the autocast the actor entry edits, split over three lines.
    entry = next(e for e in PATCH_SET["verl_patches_set_v0_4_1"]["entries"] if e["id"] == "actor-autocast")
    split = "with torch.autocast(\\n    device_type=self.device_name, dtype=torch.bfloat16\\n):"
    edit = (
        "import pathlib, sys; p = pathlib.Path(sys.argv[1]); t = p.read_text(); "
        "old = 'with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):'; assert old in t; "
        f"p.write_text(t.replace(old, '{split}'))"
    )
    fleet.sh(HOST, f'python3 -c "{edit}" {VERL}/{ACTOR}', user=OWNER)
    edited = tree(fleet, VERL)
    moved = fleet.play(HOST, stages=("verl_patches",))
    assert messages(moved) == [
        f"{HOST}: patch set verl-0.4.1-r2 does not fit the verl 0.4.1 files in {VERL} (current content); entries"
        f" that did not match: actor-autocast ({ACTOR}): anchor /{entry['anchor']}/ found 0x, expected 1x. Nothing"
        " was changed. Reinstall verl from the pinned release (the files were edited by hand) or fix the patch set."
    ]
    assert tree(fleet, VERL) == edited
    assert fleet.sh(HOST, f"ls -A {STATE}") == ""

    # A checkout of a release the role has no patch set for.
    fleet.sh(HOST, f"git -C {VERL} checkout -- . && echo 0.4.0 > {VERL}/verl/version/version", user=OWNER)
    try:
        other = tree(fleet, VERL)
        # Not the release the inventory pins: refused before the patch sets are looked at.
        mismatch = fleet.play(HOST, stages=("verl_patches",))
        assert messages(mismatch) == [
            f"{HOST}: verl_patches_verl_version is 0.4.1 but {VERL}/verl/version/version says '0.4.0'. Nothing was"
            " changed. Reinstall verl 0.4.1 (verl role) or correct p40fleet_verl_version."
        ]
        # The inventory says 0.4.0 too: no patch set for it.
        unsupported = fleet.play(HOST, stages=("verl_patches",), extra_vars={"verl_patches_verl_version": "0.4.0"})
        assert messages(unsupported) == [
            f"{HOST}: verl '0.4.0' in {VERL} has no patch set (supported: 0.4.1, 0.5.0), and GPU profile pascal needs"
            " patches. Nothing was changed. Install a supported verl, or add"
            " roles/verl_patches/vars/main/patchsets/verl-0.4.0.yml written against that release."
        ]
        assert tree(fleet, VERL) == other
        assert fleet.sh(HOST, f"ls -A {STATE}") == ""
    finally:
        fleet.sh(HOST, f"git -C {VERL} checkout -- .", user=OWNER)
    fleet.converge(HOST)
