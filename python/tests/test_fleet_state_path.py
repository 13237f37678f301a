"""The privilege model's one enforcement point (plugins/modules/fleet_state_path.py), without hosts.

Run as root on the test machine (as `make test` is), in a tree under pytest's tmp_path. `nobody` plays the env
owner (the one non-root account root lets own directories); `daemon` plays any other account. Each case is an
attack the env owner (or another account) can stage, and asserts the refusal names the path and what was found,
and that nothing outside the tree changed owner, mode or content.
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import threading

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main

path_module = load_module(REPO_ROOT / "plugins" / "modules" / "fleet_state_path.py", "fleet_state_path")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to other accounts needs root")

OWNER = "nobody"
OTHER = "daemon"
OWNER_UID = pwd.getpwnam(OWNER).pw_uid
OTHER_UID = pwd.getpwnam(OTHER).pw_uid


def act(path, state="directory", owner="root", mode="0755", check_mode=False, **extra):
    arguments = {"path": str(path), "state": state, "owner": owner, "trusted_owner": OWNER, "mode": mode, **extra}
    if state == "absent":
        arguments.pop("mode")
    return path_module.run(path_module.options(arguments), check_mode)


def refused(path, **kwargs) -> str:
    with pytest.raises(path_module.Refused) as error:
        act(path, **kwargs)
    return str(error.value)


def snapshot(path):
    info = os.lstat(path)
    with open(path, "rb") if stat.S_ISREG(info.st_mode) else open(os.devnull, "rb") as handle:
        content = handle.read() if stat.S_ISREG(info.st_mode) else None
    return info.st_uid, stat.S_IMODE(info.st_mode), content


@pytest.fixture
def tree(tmp_path):
    """root/ (root's, 0755), owned/ (the owner's, inside root/), a system file and a system directory."""
    root = tmp_path / "root"
    root.mkdir(mode=0o755)
    owned = root / "owned"
    owned.mkdir(mode=0o755)
    os.chown(owned, OWNER_UID, -1)
    system = tmp_path / "system"
    system.mkdir(mode=0o755)
    (system / "sudoers").write_text("root ALL=(ALL) ALL\n")
    os.chmod(system / "sudoers", 0o440)
    return root, owned, system


def test_an_owner_directory_is_made_in_roots_tree_and_a_rerun_changes_nothing(tree):
    root, _, _ = tree
    assert act(root / "data", owner=OWNER)["changed"]
    info = os.lstat(root / "data")
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (OWNER_UID, pwd.getpwnam(OWNER).pw_gid, 0o755)
    assert not act(root / "data", owner=OWNER)["changed"]


def test_an_existing_root_directory_is_never_handed_to_the_owner(tree):
    # The attack: a forged prefix fact named /srv/canary, and root gave the owner that directory and its contents.
    root, _, system = tree
    before = snapshot(system), snapshot(system / "sudoers")
    message = refused(system, owner=OWNER)
    assert f"{system} is a directory owned by root, mode 0755" in message
    assert f"root gives {OWNER} only a directory it makes itself" in message
    assert (snapshot(system), snapshot(system / "sudoers")) == before
    # The dry run refuses it the same way; one the owner already owns is kept as it is.
    refused(system, owner=OWNER, check_mode=True)
    act(root / "owned", owner=OWNER)
    assert os.lstat(root / "owned").st_uid == OWNER_UID


def test_a_directory_swapped_for_a_symlink_is_refused_and_its_target_keeps_its_owner(tree):
    # The attack: /opt/p40fleet/data/gsm8k replaced by a link to /usr/local/sbin before a re-run.
    _, owned, system = tree
    before = snapshot(system)
    os.symlink(system, owned / "gsm8k")
    message = refused(owned / "gsm8k", owner=OWNER)
    assert f"{owned}/gsm8k is a symlink owned by root" in message
    assert snapshot(system) == before
    # The same link as a parent component: nothing below it is made.
    message = refused(owned / "gsm8k" / "raw", owner=OWNER)
    assert f"{owned}/gsm8k is a symlink" in message and str(system) in message
    assert not (system / "raw").exists()


def test_an_owner_made_link_is_never_followed_even_where_root_could(tree):
    root, _, system = tree
    link = root / "link"
    os.symlink(system, link)
    os.chown(link, OWNER_UID, OWNER_UID, follow_symlinks=False)
    message = refused(link / "x", owner=OWNER)
    assert f"{link} is a symlink owned by {OWNER}" in message
    assert not (system / "x").exists()


def test_an_administrators_link_in_roots_tree_is_followed(tree):
    root, _, system = tree
    os.symlink(system, root / "admin-link")
    result = act(root / "admin-link" / "made", owner=OWNER)
    assert result["path"].endswith("/system/made")
    assert os.lstat(system / "made").st_uid == OWNER_UID


def test_a_staging_directory_another_account_made_first_is_refused(tmp_path):
    # /var/tmp is root's and sticky: anyone may make /var/tmp/p40fleet first and then swap what root stages there.
    sticky = tmp_path / "vartmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    staging = sticky / "p40fleet"
    staging.mkdir()
    os.chmod(staging, 0o777)
    os.chown(staging, OTHER_UID, -1)
    message = refused(staging, owner="root", mode="0700")
    assert f"{staging} is a directory owned by {OTHER}, mode 0777" in message
    assert os.lstat(staging).st_uid == OTHER_UID
    # A link planted there instead.
    os.rmdir(staging)
    os.symlink(tmp_path, staging)
    assert "is a symlink" in refused(staging, owner="root", mode="0700")
    # Nothing there: root makes it first, 0700, and a re-run keeps it.
    os.unlink(staging)
    assert act(staging, owner="root", mode="0700")["changed"]
    assert snapshot(staging)[:2] == (0, 0o700)
    assert not act(staging, owner="root", mode="0700")["changed"]


def test_a_staging_directory_of_root_that_others_can_write_is_refused(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    os.chmod(staging, 0o777)
    assert "writable by accounts other than root" in refused(staging, owner="root", mode="0700")


def test_roots_directory_is_never_made_where_the_owner_controls_the_parent(tree):
    _, owned, _ = tree
    message = refused(owned / "state", owner="root", mode="0700")
    assert f"{owned}/state: root's directory would be made in one the env owner controls" in message
    assert not (owned / "state").exists()


def test_a_parent_another_account_can_write_is_refused(tree):
    root, _, _ = tree
    shared = root / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    os.chown(shared, 0, OTHER_UID)
    assert f"{shared} is a directory owned by root, mode 0775" in refused(shared / "x", owner=OWNER)


def test_a_directory_an_earlier_run_gave_the_owner_is_taken_back_only_when_asked(tree):
    # /opt/p40fleet was the owner's before the privilege model: root takes it back, it does not chown what is in it.
    _, owned, _ = tree
    (owned / "inside").mkdir()
    os.chown(owned / "inside", OWNER_UID, -1)
    assert f"{owned} is a directory owned by {OWNER}" in refused(owned, owner="root")
    assert act(owned, owner="root", reclaim=True)["changed"]
    assert os.lstat(owned).st_uid == 0
    assert os.lstat(owned / "inside").st_uid == OWNER_UID


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory", "foreign"])
def test_a_file_written_into_the_owners_tree_refuses_what_the_owner_planted_there(tree, plant):
    _, owned, system = tree
    dest = owned / "pip.conf"
    if plant == "symlink":
        os.symlink(system / "sudoers", dest)
        found = "a symlink owned by root"
    elif plant == "fifo":
        os.mkfifo(dest)
        found = "a FIFO owned by root"
    elif plant == "directory":
        dest.mkdir()
        found = "a directory owned by root"
    else:
        dest.write_text("x")
        os.chown(dest, OTHER_UID, -1)
        found = f"a regular file owned by {OTHER}"
    before = snapshot(system / "sudoers")
    # A FIFO opened without O_NONBLOCK would hang here: the refusal must come at once.
    done = []
    worker = threading.Thread(
        target=lambda: done.append(refused(dest, state="file", owner=OWNER, content="[x]\n")), daemon=True
    )
    worker.start()
    worker.join(10)
    assert done, "the write hung on what was planted"
    assert f"{dest} is {found}" in done[0]
    if plant == "symlink":
        assert f"to {system}/sudoers, where a regular file owned by {OWNER} belongs" in done[0]
    assert snapshot(system / "sudoers") == before


def test_a_file_is_written_whole_with_its_owner_and_mode_and_a_rerun_changes_nothing(tree):
    _, owned, _ = tree
    dest = owned / "token"
    assert act(dest, state="file", owner=OWNER, mode="0600", content="hf_secret")["changed"]
    assert snapshot(dest) == (OWNER_UID, 0o600, b"hf_secret")
    assert not act(dest, state="file", owner=OWNER, mode="0600", content="hf_secret")["changed"]
    assert act(dest, state="file", owner=OWNER, mode="0600", content_base64="aGZfbmV3")["changed"]
    assert snapshot(dest) == (OWNER_UID, 0o600, b"hf_new")
    assert sorted(os.listdir(owned)) == ["token"]


def test_a_file_behind_a_linked_directory_is_refused(tree):
    _, owned, system = tree
    os.symlink(system, owned / "env")
    message = refused(owned / "env" / "sudoers", state="file", owner=OWNER, content="owned\n")
    assert f"{owned}/env is a symlink" in message
    assert snapshot(system / "sudoers")[2] == b"root ALL=(ALL) ALL\n"


def test_removing_a_planted_link_removes_the_link_not_its_target(tree):
    _, owned, system = tree
    os.symlink(system / "sudoers", owned / "token")
    assert act(owned / "token", state="absent")["changed"]
    assert not os.path.lexists(owned / "token")
    assert (system / "sudoers").exists()
    assert not act(owned / "token", state="absent")["changed"]
    assert not act(owned / "missing-dir" / "token", state="absent")["changed"]


def test_the_module_result_says_what_the_walk_saw_and_never_what_a_planted_link_points_at(tree, monkeypatch):
    """Through AnsibleModule as a task runs it: its add_path_info would stat the path following links and report
    the target's owner, mode and size as the result's; and its invocation log would write a file's content to the
    host's journal."""
    _, owned, system = tree
    os.symlink(system / "sudoers", owned / "token")
    logged = []
    monkeypatch.setattr(path_module.AnsibleModule, "_log_invocation", lambda self: logged.append(self.params))
    args = {"path": str(owned / "token"), "state": "absent", "trusted_owner": OWNER, "host": "node1"}
    result = run_module_main(path_module, args, check_mode=True)
    assert (result["rc"], result["changed"], result["path"]) == (0, True, str(owned / "token"))
    assert not {"uid", "owner", "mode", "size", "state"} & set(result), result
    written = {"path": str(owned / "pip.conf"), "state": "file", "owner": OWNER, "trusted_owner": OWNER}
    result = run_module_main(path_module, {**written, "mode": "0600", "content": "password = canary-4f1e\n"})
    assert result["rc"] == 0 and "canary-4f1e" not in json.dumps(result)
    assert (owned / "pip.conf").read_text() == "password = canary-4f1e\n" and logged == []
    result = run_module_main(path_module, {**written, "mode": "0600", "force": True})
    assert result["rc"] == 1 and "Unsupported parameters" in result["msg"] and "force" in result["msg"]


def batch(items, check_mode=False, **common):
    arguments = {"owner": "root", "trusted_owner": OWNER, "mode": "0755", "batch": items, **common}
    return path_module.run_batch(arguments, check_mode)


def test_a_batch_makes_a_tree_in_order_and_a_rerun_changes_nothing(tree):
    root, _, _ = tree
    items = [
        {"path": str(root / "state" / "applied.json"), "state": "absent"},
        {"path": str(root / "state")},
        {"path": str(root / "state" / "pristine"), "mode": "0700"},
        {"path": str(root / "state" / "pristine" / "a.py"), "state": "file", "mode": "0644", "content_base64": "QQ=="},
        {"path": str(root / "state" / "pristine.json"), "state": "file", "mode": "0644", "content": "{}\n"},
    ]
    result = batch(items)
    assert result["changed"] and [r["changed"] for r in result["results"]] == [False, True, True, True, True]
    # A plain path is a request with the task's options.
    assert batch([str(root / "state" / "plain")], mode="0750")["changed"]
    assert snapshot(root / "state" / "plain")[:2] == (0, 0o750)
    assert snapshot(root / "state")[:2] == (0, 0o755)
    assert snapshot(root / "state" / "pristine")[:2] == (0, 0o700)
    assert snapshot(root / "state" / "pristine" / "a.py") == (0, 0o644, b"A")
    assert not batch(items)["changed"]
    assert not batch(items, check_mode=True)["changed"]


def test_a_batch_stops_at_its_first_refusal_and_each_item_is_checked_as_a_task_would_be(tree):
    root, owned, system = tree
    os.symlink(system, owned / "env")
    items = [
        {"path": str(root / "made")},
        {"path": str(owned / "env" / "sudoers"), "state": "file", "owner": OWNER, "content": "owned\n"},
        {"path": str(root / "never")},
    ]
    with pytest.raises(path_module.Refused, match=f"{owned}/env is a symlink"):
        batch(items)
    assert (root / "made").is_dir() and not (root / "never").exists()
    assert snapshot(system / "sudoers")[2] == b"root ALL=(ALL) ALL\n"
    # Root's directory where the owner controls the parent: refused inside a batch as alone.
    with pytest.raises(path_module.Refused, match="root's directory would be made in one the env owner controls"):
        batch([{"path": str(owned / "rootdir")}])


def test_a_batch_item_with_a_bad_option_is_named_and_contents_are_never_logged(tree):
    root, _, _ = tree
    with pytest.raises(path_module.BatchItemFailed, match="unsupported option") as error:
        batch([{"path": str(root / "x"), "force": True}])
    assert error.value.path == str(root / "x")
    with pytest.raises(ValueError, match="option batch must be a list of paths or dicts"):
        batch([{"path": str(root / "x"), "batch": []}])
    with pytest.raises(ValueError, match="option batch must be a list of paths or dicts"):
        batch([7])
    shown = path_module.without_content(
        {"path": "/a", "content": "hf_secret", "batch": [{"path": "/b", "content_base64": "aGZfc2VjcmV0"}]}
    )
    assert shown == {"path": "/a", "batch": [{"path": "/b"}]}


def test_check_mode_changes_nothing(tree):
    root, owned, _ = tree
    assert act(root / "new", owner=OWNER, check_mode=True)["changed"]
    assert not (root / "new").exists()
    assert act(owned / "f", state="file", owner=OWNER, content="x", check_mode=True)["changed"]
    assert not (owned / "f").exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"path": "relative/dir", "mode": "0755"}, "is not an absolute path"),
        ({"path": "/opt/../etc/sudoers.d", "mode": "0755"}, "has a '..' component"),
        ({"path": "/opt/x", "mode": "0755", "owner": OTHER}, f"would belong to {OTHER}, who is neither root"),
        ({"path": "/opt/x", "mode": "0755", "owner": "no-such-account-p40"}, "does not exist"),
    ],
)
def test_paths_and_owners_outside_the_model_are_refused(arguments, message):
    with pytest.raises(path_module.Refused, match=message.replace(".", r"\.")):
        path_module.run(path_module.options({"trusted_owner": OWNER, **arguments}), True)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"path": "/x", "mode": "rwx"}, "option mode must be an octal mode"),
        ({"path": "/x", "state": "file", "mode": "0644"}, "needs exactly one of content and content_base64"),
        ({"path": "/x", "state": "link", "mode": "0644"}, "option state must be one of"),
        ({"path": "/x", "mode": "0644", "force": True}, "unsupported option"),
    ],
)
def test_bad_options_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        path_module.options(arguments)


def test_a_dry_run_before_the_env_owner_exists_reports_the_owners_paths_as_to_be_made(tmp_path):
    # conda_env's user task only pretends in check mode; the owner's prefix is what the real run would make.
    arguments = {"path": str(tmp_path / "prefix"), "owner": "no-such-account-p40", "mode": "0755"}
    arguments["trusted_owner"] = arguments["owner"]
    assert path_module.run(path_module.options(arguments), True) == {"changed": True, "path": arguments["path"]}
    assert not (tmp_path / "prefix").exists()
    with pytest.raises(path_module.Refused, match="the account 'no-such-account-p40' does not exist"):
        path_module.run(path_module.options(arguments), False)


def test_an_env_owner_not_made_yet_is_trusted_with_nothing(tmp_path):
    # Root's staging comes before conda_env makes the owner: root's directories are still made and checked.
    arguments = {
        "path": str(tmp_path / "staging"),
        "owner": "root",
        "trusted_owner": "no-such-account-p40",
        "mode": "0700",
    }
    assert path_module.run(path_module.options(arguments), False)["changed"]
    assert snapshot(tmp_path / "staging")[:2] == (0, 0o700)


def test_a_tree_is_removed_only_through_descriptors_and_never_behind_a_swapped_parent(tree):
    # The attack: the env's removal followed a link the owner put in place of envs/, and root removed a directory of
    # that name anywhere.
    _, owned, system = tree
    (system / "verl-env").mkdir()
    (system / "verl-env" / "keep").write_text("root's\n")
    os.symlink(system, owned / "envs")
    before = snapshot(system / "verl-env" / "keep")
    message = refused(owned / "envs" / "verl-env", state="absent", recurse=True)
    assert f"{owned}/envs is a symlink" in message
    assert snapshot(system / "verl-env" / "keep") == before
    # A real env tree goes whole; a link inside it is removed, never followed.
    os.unlink(owned / "envs")
    env = owned / "envs" / "verl-env"
    (env / "bin").mkdir(parents=True)
    os.symlink(system, env / "bin" / "escape")
    assert refused(env, state="absent").endswith("where a file was to be removed")
    assert act(env, state="absent", recurse=True)["changed"]
    assert not env.exists() and snapshot(system / "verl-env" / "keep") == before
    assert not act(env, state="absent", recurse=True)["changed"]


@pytest.mark.parametrize("rmtree_dir_fd", [True, False], ids=["python-3.11", "before-3.11"])
def test_a_tree_with_links_inside_goes_whole_and_nothing_behind_a_link_goes_with_it(tree, monkeypatch, rmtree_dir_fd):
    """Before Python 3.11 shutil.rmtree has no dir_fd (Debian 11's 3.9, Ubuntu 22.04's 3.10 raised TypeError): the
    module's own walk removes the tree the same way, links unlinked, never followed."""
    monkeypatch.setattr(path_module, "RMTREE_DIR_FD", rmtree_dir_fd)
    _, owned, system = tree
    (system / "keep").write_text("root's\n")
    before = snapshot(system / "keep")
    env = owned / "envs" / "verl-env"
    (env / "lib" / "site").mkdir(parents=True)
    (env / "lib" / "site" / "mod.py").write_text("x = 1\n")
    os.symlink(system, env / "lib" / "escape")
    os.symlink(system / "keep", env / "keep-link")
    os.mkfifo(env / "fifo")
    assert act(env, state="absent", recurse=True)["changed"]
    assert not env.exists() and snapshot(system / "keep") == before and (owned / "envs").is_dir()
    # A link where a directory was: unlinked, what it names left as it was.
    (env / "sub").mkdir(parents=True)
    os.rmdir(env / "sub")
    os.symlink(system, env / "sub")
    assert act(env, state="absent", recurse=True)["changed"]
    assert snapshot(system / "keep") == before and system.is_dir()


def test_in_diff_mode_a_changed_file_returns_its_diff_and_a_dry_run_writes_nothing(tree):
    _, owned, _ = tree
    dest = owned / "train.sh"
    made = act(dest, state="file", owner=OWNER, content="a\nb\n", _ansible_diff=True)
    assert made["diff"] == {
        "before_header": f"{dest} (absent)", "after_header": str(dest), "before": "", "after": "a\nb\n",
    }  # fmt: skip
    planned = act(dest, state="file", owner=OWNER, mode="0700", content="a\nc\n", _ansible_diff=True, check_mode=True)
    assert planned["changed"]
    assert planned["diff"]["before"] == "a\nb\n"
    assert planned["diff"]["after"] == "a\nc\n"
    assert planned["diff"]["after_header"] == f"{dest} (mode 0755 -> 0700)"
    assert snapshot(dest) == (OWNER_UID, 0o755, b"a\nb\n")
    # Converged: no change, no diff; without --diff, no diff either.
    assert "diff" not in act(dest, state="file", owner=OWNER, content="a\nb\n", _ansible_diff=True)
    assert "diff" not in act(dest, state="file", owner=OWNER, content="a\nd\n")


def test_a_secret_files_diff_shows_its_names_and_never_a_value(tree):
    _, owned, _ = tree
    dest = owned / "env"
    old = "# Managed by p40fleet\nexport HF_TOKEN='hf_old_secret'\n"
    act(dest, state="file", owner=OWNER, mode="0600", content=old)
    new = "# Managed by p40fleet\nexport HF_TOKEN='hf_new_secret'\nexport WANDB_API_KEY=wb_secret\n"
    result = act(dest, state="file", owner=OWNER, mode="0600", content=new, secret=True, _ansible_diff=True)
    diff = result["diff"]
    assert diff["before"] == "# Managed by p40fleet\nexport HF_TOKEN=********\n"
    assert diff["after"] == "# Managed by p40fleet\nexport HF_TOKEN=********\nexport WANDB_API_KEY=********\n"
    assert "(secret: values masked)" in diff["after_header"]
    assert not any(value in str(diff) for value in ("hf_old_secret", "hf_new_secret", "wb_secret"))
    # A batch's diffs come back at the top, in order, masked per item.
    items = [
        {"path": str(owned / "t1"), "content": "hf_a\n", "secret": True},
        {"path": str(owned / "t2"), "content": "p\n"},
    ]
    common = {"state": "file", "owner": OWNER, "trusted_owner": OWNER, "mode": "0600", "_ansible_diff": True}
    batch = path_module.run_batch({**common, "batch": items}, True)
    assert [d["after"] for d in batch["diff"]] == ["********\n", "p\n"]
    assert all("diff" not in item for item in batch["results"])


@pytest.mark.parametrize(
    ("content", "shown"),
    [
        ("export A='x y'\n", "export A=********\n"),
        ("[global]\nindex-url = https://u:pw@mirror/simple\n", "[global]\nindex-url = ********\n"),
        ("channels:\n  - https://conda.example/t/tok/main\nyes: true\n", "channels:\n  ********\nyes: ********\n"),
        ("hf_bare_token", "********"),
        ("\n# note\n", "\n# note\n"),
    ],
)
def test_masking_keeps_the_shape_and_drops_every_value(content, shown):
    assert path_module.masked(content) == shown


def test_a_diff_names_binary_and_oversized_content_instead_of_showing_it():
    assert path_module.shown(b"\x00\xff", secret=False) == "(binary content, 2 bytes)\n"
    big = b"x" * (path_module.DIFF_LIMIT + 1)
    assert "over the 104448-byte diff limit" in path_module.shown(big, secret=False)
