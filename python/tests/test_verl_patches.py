"""verl_patches against the real verl source (PyPI sdists listed in fixtures/upstream.txt).

The fast tests run the role with ansible-playbook over a local connection on a copy of the extracted
sdist. Every assertion reads the files themselves. Over SSH on sandbox hosts: the molecule scenario verl_patches
(a P40 and a V100 through gpu_preflight: converge, idempotence, the edits, the record and pristine copies) and
fault cases 7 and 8 (revert to the release, refusals, on a converged host).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.local_hosts import ROOT_PLAYS_OWNER

PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "verl_patches.yml"
SDIST_DIR = UPSTREAM_DIR / "sdist"

# What gpu_preflight publishes (roles/gpu_preflight/defaults/main.yml, gpu_preflight_profiles).
PASCAL = {
    "name": "pascal",
    "compute_cap": "6.1",
    "dtype": "float32",
    "attn_implementation": "eager",
    "shared_memory_per_block": 49152,
    "needs_patches": True,
}
VOLTA = {
    "name": "volta",
    "compute_cap": "7.0",
    "dtype": "float16",
    "attn_implementation": "sdpa",
    "shared_memory_per_block": 98304,
    "needs_patches": True,
}
MODERN = {
    "name": "modern",
    "compute_cap": "8.0",
    "dtype": "bfloat16",
    "attn_implementation": "flash_attention_2",
    "shared_memory_per_block": 101376,
    "needs_patches": False,
}

COVERED = [
    "verl/workers/fsdp_workers.py",
    "verl/utils/model.py",
    "verl/workers/actor/dp_actor.py",
    "verl/workers/critic/dp_critic.py",
    "verl/workers/rollout/hf_rollout.py",
    "verl/utils/torch_functional.py",
]

# The edited lines a Pascal host must end up with in verl 0.4.1 (file, line number, text), read from
# the release: the anchors in docs/facts.md ("Where bf16 is forced"), plus the Triton cross-entropy switch.
# The lines a host's verl 0.4.1 must lose (file, line number in the release, text): generate() derives the positions.
REMOVED_LINES_041 = [("verl/workers/rollout/hf_rollout.py", 113, "                position_ids=position_ids,")]
PASCAL_LINES_041 = [
    (
        "verl/workers/actor/dp_actor.py",
        100,
        "        with torch.autocast(device_type=self.device_name, dtype=torch.float32, enabled=False):",
    ),
    (
        "verl/workers/critic/dp_critic.py",
        65,
        "        with torch.autocast(device_type=self.device_name, dtype=torch.float32, enabled=False):",
    ),
    (
        "verl/workers/rollout/hf_rollout.py",
        109,
        "        with param_ctx, torch.autocast(device_type=get_device_name(), dtype=torch.float32, enabled=False):",
    ),
    (
        "verl/workers/fsdp_workers.py",
        216,
        "            torch_dtype = torch.float32 if self._is_actor else torch.float32",
    ),
    (
        "verl/workers/fsdp_workers.py",
        221,
        "        actor_model_config = AutoConfig.from_pretrained(local_path, trust_remote_code=trust_remote_code,"
        ' attn_implementation="eager")',
    ),
    (
        "verl/workers/fsdp_workers.py",
        294,
        '            param_dtype = PrecisionType.to_dtype(mixed_precision_config.get("param_dtype", "fp32"))',
    ),
    ("verl/workers/fsdp_workers.py", 298, "            param_dtype = torch.float32"),
    (
        "verl/workers/fsdp_workers.py",
        910,
        '        critic_model_config = AutoConfig.from_pretrained(local_path, attn_implementation="eager",'
        ' trust_remote_code=config.model.get("trust_remote_code", False))',
    ),
    (
        "verl/workers/fsdp_workers.py",
        966,
        '            param_dtype = PrecisionType.to_dtype(mixed_precision_config.get("param_dtype", "fp32"))',
    ),
    ("verl/workers/fsdp_workers.py", 970, "            param_dtype = torch.float32"),
    ("verl/workers/fsdp_workers.py", 1240, "                torch_dtype=torch.float32,"),
    ("verl/workers/fsdp_workers.py", 1241, '                attn_implementation="eager",'),
    ("verl/workers/fsdp_workers.py", 1251, "            reward_module.to(torch.float32)"),
    (
        "verl/workers/fsdp_workers.py",
        671,
        '        timing_generate.update(getattr(self.rollout_sharding_manager, "timing", {}))',
    ),
    (
        "verl/workers/fsdp_workers.py",
        1300,
        "        with torch.no_grad(), torch.autocast(device_type=device_name, dtype=torch.float32, enabled=False):",
    ),
    ("verl/utils/model.py", 511, '            attn_implementation="eager",'),
    ("verl/utils/model.py", 531, '        attn_implementation="eager",'),
    ("verl/utils/torch_functional.py", 36, "    FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False"),
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    """The real verl sdists, extracted once: {version: source root holding verl/}."""
    out = tmp_path_factory.mktemp("verl-sdists")
    trees = {}
    for version in ("0.4.1", "0.5.0", "0.4.0"):
        archive = SDIST_DIR / f"verl-{version}.tar.gz"
        if not archive.exists():
            pytest.fail(f"{archive} is missing: run `make fixtures` (python/tests/fixtures/upstream.txt lists it)")
        with tarfile.open(archive) as tar:
            tar.extractall(out, filter="data")
        trees[version] = out / f"verl-{version}"
    return trees


@dataclass
class Workspace:
    """A stand-in for one host's verl checkout and the role's state dir, on this machine."""

    root: Path
    src: Path
    state: Path
    inventory: Path
    facts: Path

    def load(self, tree: Path) -> None:
        """Put a release where the checkout is, as the verl role would on install or upgrade."""
        if self.src.exists():
            shutil.rmtree(self.src)
        shutil.copytree(tree, self.src)

    def read(self, rel: str) -> str:
        return (self.src / rel).read_text()

    def record(self) -> dict | None:
        path = self.state / "applied.json"
        return json.loads(path.read_text()) if path.exists() else None


@pytest.fixture
def ws(tmp_path, releases) -> Workspace:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n    localhost:\n      ansible_connection: local\n"
        f"      ansible_python_interpreter: {sys.executable}\n"
        # The files are the test's own: no sudo on the controller (the variable outranks the tasks' become).
        "      ansible_become: false\n"
    )
    workspace = Workspace(tmp_path, tmp_path / "verl", tmp_path / "state", inventory, tmp_path / "facts")
    workspace.load(releases["0.4.1"])
    return workspace


@pytest.fixture
def play(run_playbook):
    def run(ws: Workspace, profile: dict | None = PASCAL, **kwargs):
        extra = {
            "verl_patches_source_dir": str(ws.src),
            "verl_patches_state_dir": str(ws.state),
            "verl_patches_python": "/usr/bin/python3",
            # The test's own files, in root's temporary directory: root plays the checkout's owner.
            "verl_patches_source_owner": "root",
            # The role alone on whichever release the workspace holds: the source's own version, not the fleet's.
            "verl_patches_verl_version": "",
        }
        if profile is not None:
            extra["verl_patches_profile"] = profile
        extra.update(kwargs.pop("extra_vars", {}))
        # Keep this run's cached facts out of the repository's fact cache.
        envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(ws.facts), **ROOT_PLAYS_OWNER}
        return run_playbook(PLAYBOOK, ws.inventory, extra_vars=extra, envvars=envvars, **kwargs)

    return run


def messages(result) -> str:
    return "\n".join(f.message for f in result.failures)


def assert_pascal_041(ws: Workspace, pristine: Path) -> None:
    for rel, number, text in PASCAL_LINES_041:
        assert ws.read(rel).splitlines()[number - 1] == text, (rel, number)
    for rel in COVERED:
        source = ws.read(rel)
        compile(source, rel, "exec")
        assert "flash_attention_2" not in source, rel
        assert not re.search(r'torch\.bfloat16|"bf16"', source), rel
    # Only the covered files differ from the release, each only in the lines listed above.
    before, after = tree_digest(pristine), tree_digest(ws.src)
    assert sorted(rel for rel in before if before[rel] != after.get(rel)) == sorted(COVERED)
    assert set(before) == set(after)
    for rel in COVERED:
        old, new = (pristine / rel).read_text().splitlines(), ws.read(rel).splitlines()
        removed = {n: text for r, n, text in REMOVED_LINES_041 if r == rel}
        assert all(old[n - 1] == text for n, text in removed.items()), rel
        old = [line for number, line in enumerate(old, start=1) if number not in removed]
        changed = {i + 1 for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b}
        assert changed == {n for r, n, _ in PASCAL_LINES_041 if r == rel}, rel


def test_apply_reapply_verify_and_revert_on_verl_041(ws, play, releases):
    first = play(ws)
    assert first.rc == 0, messages(first)
    assert first.stats["localhost"]["changed"] > 0
    assert_pascal_041(ws, releases["0.4.1"])

    record = ws.record()
    assert record["identity"]["patch_set"] == "verl-0.4.1-r3"
    assert record["identity"]["verl_version"] == "0.4.1"
    assert record["identity"]["profile"]["name"] == "pascal"
    assert sorted(record["files"]) == sorted(COVERED)
    for rel, item in record["files"].items():
        assert item["patched_sha256"] == sha256(ws.src / rel)
        assert item["pristine_sha256"] == sha256(releases["0.4.1"] / rel)
        assert sha256(ws.state / "pristine" / rel) == sha256(releases["0.4.1"] / rel)

    patched = tree_digest(ws.src)
    again = play(ws)
    assert again.rc == 0, messages(again)
    assert again.stats["localhost"]["changed"] == 0
    checked = play(ws, check=True, diff=True)
    assert checked.rc == 0 and checked.stats["localhost"]["changed"] == 0
    verified = play(ws, tags="verify")
    assert verified.rc == 0 and verified.stats["localhost"]["changed"] == 0
    assert tree_digest(ws.src) == patched

    # absent restores the release byte for byte and leaves no state behind; a second absent is a no-op.
    reverted = play(ws, extra_vars={"verl_patches_state": "absent"})
    assert reverted.rc == 0, messages(reverted)
    assert tree_digest(ws.src) == tree_digest(releases["0.4.1"])
    assert not any(ws.state.iterdir())
    again = play(ws, extra_vars={"verl_patches_state": "absent"})
    assert again.rc == 0 and again.stats["localhost"]["changed"] == 0


def test_check_diff_shows_the_edits_and_changes_nothing(ws, play, releases):
    result = play(ws, check=True, diff=True)
    assert result.rc == 0, messages(result)
    assert result.stats["localhost"]["changed"] > 0
    assert "-        with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):" in result.stdout
    assert (
        "+        with torch.autocast(device_type=self.device_name, dtype=torch.float32, enabled=False):"
        in result.stdout
    )
    assert '+            attn_implementation="eager",' in result.stdout
    assert "+    FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False" in result.stdout
    assert tree_digest(ws.src) == tree_digest(releases["0.4.1"])
    assert not ws.state.exists() or not any(ws.state.iterdir())


def test_unknown_version_fails_closed_before_any_edit(ws, play, releases):
    ws.load(releases["0.4.0"])
    result = play(ws)
    assert result.rc != 0
    assert "localhost: verl '0.4.0' in " + str(ws.src) + " has no patch set (supported: 0.4.1, 0.5.0)" in messages(
        result
    )
    assert "Nothing was changed" in messages(result)
    assert tree_digest(ws.src) == tree_digest(releases["0.4.0"])
    assert not ws.state.exists()


def test_moved_anchor_fails_closed_naming_the_entries(ws, play):
    actor = ws.src / "verl/workers/actor/dp_actor.py"
    actor.write_text(
        actor.read_text().replace(
            "with torch.autocast(device_type=self.device_name, dtype=torch.bfloat16):",
            "with torch.autocast(\n            device_type=self.device_name, dtype=torch.bfloat16\n        ):",
        )
    )
    model = ws.src / "verl/utils/model.py"
    model.write_text(model.read_text() + '\n\nEXTRA = dict(attn_implementation="flash_attention_2")\n')
    before = tree_digest(ws.src)
    result = play(ws)
    assert result.rc != 0
    text = messages(result)
    assert "actor-autocast (verl/workers/actor/dp_actor.py): anchor" in text
    assert "found 0x, expected 1x" in text
    assert "valuehead-model-attn (verl/utils/model.py): anchor" in text
    assert "found 3x, expected 2x" in text
    assert "critic-autocast" not in text
    assert tree_digest(ws.src) == before
    assert not ws.state.exists()


def test_upgrade_to_050_reapplies_and_reverts_to_the_new_release(ws, play, releases):
    assert play(ws).rc == 0
    ws.load(releases["0.5.0"])  # the verl role replaced the checkout
    upgraded = play(ws)
    assert upgraded.rc == 0, messages(upgraded)
    assert ws.record()["identity"]["patch_set"] == "verl-0.5.0-r2"
    assert json.loads((ws.state / "pristine.json").read_text())["verl_version"] == "0.5.0"
    for rel in COVERED:
        assert sha256(ws.state / "pristine" / rel) == sha256(releases["0.5.0"] / rel)
        assert "flash_attention_2" not in ws.read(rel)
    assert ws.read("verl/workers/fsdp_workers.py").splitlines()[1442] == (
        "        with torch.no_grad(), torch.autocast(device_type=device_name, dtype=torch.float32, enabled=False):"
    )
    assert play(ws, extra_vars={"verl_patches_state": "absent"}).rc == 0
    assert tree_digest(ws.src) == tree_digest(releases["0.5.0"])


def test_volta_gets_fp32_autocast_and_sdpa_then_a_card_swap_repatches(ws, play, releases):
    volta = play(ws, profile=VOLTA)
    assert volta.rc == 0, messages(volta)
    assert ws.read("verl/workers/actor/dp_actor.py").splitlines()[99] == (
        "        with torch.autocast(device_type=self.device_name, dtype=torch.float16, enabled=False):"
    )
    assert ws.read("verl/utils/model.py").count('attn_implementation="sdpa"') == 2
    assert 'mixed_precision_config.get("param_dtype", "fp16")' in ws.read("verl/workers/fsdp_workers.py")
    # 96 KB of shared memory: flash_attn's Triton cross-entropy fits, so it stays.
    assert sha256(ws.src / "verl/utils/torch_functional.py") == sha256(
        releases["0.4.1"] / "verl/utils/torch_functional.py"
    )
    assert ws.record()["identity"]["profile"]["name"] == "volta"

    pascal = play(ws, profile=PASCAL)
    assert pascal.rc == 0, messages(pascal)
    assert_pascal_041(ws, releases["0.4.1"])
    assert ws.record()["identity"]["profile"]["name"] == "pascal"

    modern = play(ws, profile=MODERN)  # an sm80 card needs no patches: back to the release
    assert modern.rc == 0, messages(modern)
    assert tree_digest(ws.src) == tree_digest(releases["0.4.1"])
    assert ws.record() is None


def test_interrupted_run_is_redone_from_the_pristine_copies(ws, play, releases):
    assert play(ws).rc == 0
    patched = tree_digest(ws.src)
    # As if a run died between edits: no record, one file back to the release, one half-edited.
    (ws.state / "applied.json").unlink()
    shutil.copy2(releases["0.4.1"] / "verl/workers/actor/dp_actor.py", ws.src / "verl/workers/actor/dp_actor.py")
    workers = ws.src / "verl/workers/fsdp_workers.py"
    workers.write_text(
        (releases["0.4.1"] / "verl/workers/fsdp_workers.py")
        .read_text()
        .replace(
            "torch.float32 if self._is_actor else torch.bfloat16", "torch.float32 if self._is_actor else torch.float32"
        )
    )
    redone = play(ws)
    assert redone.rc == 0, messages(redone)
    assert tree_digest(ws.src) == patched
    assert ws.record() is not None


def test_missing_gpu_profile_fails_with_a_clear_message(ws, play, releases):
    result = play(ws, profile=None)
    assert result.rc != 0
    assert "localhost: verl_patches needs the verl checkout" in messages(result)
    assert "Run the gpu_preflight and verl roles first, or set verl_patches_source_dir and verl_patches_profile" in (
        messages(result)
    )
    assert tree_digest(ws.src) == tree_digest(releases["0.4.1"])


def test_failed_post_condition_restores_the_files_and_writes_no_record(ws, play, releases, repo_root):
    # The shipped 0.4.1 set, with the Triton entry's post-condition loosened so that it also counts the
    # untouched except-branch (2 matches, 1 expected): the edits happen, the check after them fails.
    shipped = yaml.safe_load((repo_root / "roles/verl_patches/vars/main/patchsets/verl-0.4.1.yml").read_text())
    broken = shipped["verl_patches_set_v0_4_1"]
    for entry in broken["entries"]:
        if entry["id"] == "triton-cross-entropy-off":
            entry["post"] = r"^\s+FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE = False$"
    result = play(ws, extra_vars={"verl_patches_set_v0_4_1": broken})
    assert result.rc != 0
    text = messages(result)
    assert "triton-cross-entropy-off (verl/utils/torch_functional.py): post-condition found 2x, expected 1x" in text
    assert "The files were restored from " + str(ws.state) + "/pristine" in text
    assert tree_digest(ws.src) == tree_digest(releases["0.4.1"])
    assert ws.record() is None


def changed_file_message(
    host: str, ws_src: str, state: str, action: str, items: list[tuple[str, str, str, str]]
) -> str:
    """The refusal of fault case 8, as apply.yml/revert.yml word it: (file, pristine, patched, found) each."""
    listed = "; ".join(
        f"{rel} (pristine sha256 {pristine}, patched sha256 {patched}, found sha256 {found})"
        for rel, pristine, patched, found in items
    )
    return (
        f"{host}: {len(items)} verl 0.4.1 file(s) in {ws_src} changed since verl_patches last ran, and {action} them"
        f" would overwrite that change: {listed}. Nothing was changed. Keep the change elsewhere if it matters, then"
        " either put each file back as verl ships it (its pristine copy is under"
        f" {state}/pristine/) and rerun, or, if verl was reinstalled with new files under the same version, remove"
        f" {state} so that the new files become the pristine copies, and rerun."
    )


def test_a_patched_file_edited_since_the_last_run_is_refused_not_overwritten(ws, play, releases):
    assert play(ws).rc == 0
    actor = "verl/workers/actor/dp_actor.py"
    patched_sum = sha256(ws.src / actor)
    (ws.src / actor).write_text(ws.read(actor) + "\n# my own change, to keep\n")
    edited = tree_digest(ws.src)
    state = tree_digest(ws.state)
    expected = changed_file_message(
        "localhost",
        str(ws.src),
        str(ws.state),
        "patching",
        [(actor, sha256(releases["0.4.1"] / actor), patched_sum, sha256(ws.src / actor))],
    )
    for extra, action in (({}, "patching"), ({"verl_patches_state": "absent"}, "restoring")):
        refused = play(ws, extra_vars=extra)
        assert refused.rc != 0
        assert messages(refused) == expected.replace("and patching them", f"and {action} them"), messages(refused)
        assert refused.stats["localhost"]["changed"] == 0
        assert tree_digest(ws.src) == edited
        assert tree_digest(ws.state) == state
    checked = play(ws, check=True, diff=True)
    assert checked.rc != 0 and tree_digest(ws.src) == edited

    # Put back as verl ships it: the role patches it again, and the run converges.
    shutil.copy2(ws.state / "pristine" / actor, ws.src / actor)
    again = play(ws)
    assert again.rc == 0, messages(again)
    assert_pascal_041(ws, releases["0.4.1"])


def test_new_files_under_the_same_version_are_refused_until_the_state_is_removed(ws, play, releases):
    assert play(ws).rc == 0
    # The checkout replaced by other content that still says 0.4.1 (a moved tag, a re-cut sdist).
    upstream = releases["0.4.1"] / "verl/utils/model.py"
    ws.load(releases["0.4.1"])
    (ws.src / "verl/utils/model.py").write_text(upstream.read_text() + "\n# upstream: a later fix\n")
    new_files = tree_digest(ws.src)
    refused = play(ws)
    assert refused.rc != 0
    # The other covered files are back at their pristine content: patching them again loses nothing.
    model = "verl/utils/model.py"
    assert messages(refused) == changed_file_message(
        "localhost",
        str(ws.src),
        str(ws.state),
        "patching",
        [(model, sha256(upstream), ws.record()["files"][model]["patched_sha256"], new_files[model])],
    )
    assert tree_digest(ws.src) == new_files
    shutil.rmtree(ws.state)
    adopted = play(ws)
    assert adopted.rc == 0, messages(adopted)
    assert sha256(ws.state / "pristine" / model) == new_files[model]
    assert "# upstream: a later fix" in ws.read(model)
    assert "flash_attention_2" not in ws.read(model)


def test_every_patch_set_file_is_in_the_role_s_list_of_sets():
    """vars/main/main.yml names the sets one by one; a file added to patchsets/ and not listed would be ignored."""
    vars_dir = REPO_ROOT / "roles" / "verl_patches" / "vars" / "main"
    defined = {}
    for path in sorted((vars_dir / "patchsets").glob("*.yml")):
        (name, patch_set), *others = yaml.safe_load(path.read_text()).items()
        assert others == [] and path.name == f"verl-{patch_set['verl_version']}.yml", path
        defined[name] = patch_set["verl_version"]
    listed = yaml.safe_load((vars_dir / "main.yml").read_text())["verl_patches_set_list"]
    by_version = sorted(defined, key=lambda name: [int(part) for part in defined[name].split(".")])
    assert re.findall(r"\bverl_patches_set_v\w+", listed) == by_version
