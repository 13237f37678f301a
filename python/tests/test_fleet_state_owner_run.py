"""Root's one way to run the env owner's work (plugins/modules/fleet_state_owner_run.py), without hosts.

Run as root on the test machine (as `make test` is). `nobody` plays the env owner. Each case is something the
owner's process can do to the root-side module that starts it: print a forged module result, outlive its time
limit, flood its output, inherit root's environment or working directory; the result must hold only root-built
rc/stdout/stderr. (The owner's usercustomize and .pth hooks on a real host: faults/test_privileges.py.)
"""

from __future__ import annotations

import json
import os
import pwd
import time

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module, run_module_main

run_module = load_module(REPO_ROOT / "plugins" / "modules" / "fleet_state_owner_run.py", "fleet_state_owner_run")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")

OWNER = "nobody"
ENTRY = pwd.getpwnam(OWNER)


def owner_run(argv, **extra):
    return run_module.run({"owner": OWNER, "argv": argv, **extra})


def test_the_command_runs_as_the_owner_with_its_groups_and_a_clean_environment(monkeypatch):
    # Root's own environment must not reach the owner: a PYTHONPATH or LD_PRELOAD of the controller's session.
    monkeypatch.setenv("PYTHONPATH", "/root/evil")
    monkeypatch.setenv("LD_PRELOAD", "/root/evil.so")
    script = "import os, sys, json; print(json.dumps([os.getuid(), os.getgid(), sorted(os.getgroups()), "
    script += "dict(os.environ), os.umask(0), os.getcwd(), sys.flags.no_user_site]))"
    result = owner_run(["/usr/bin/python3", "-I", "-c", script], environment={"TMPDIR": "/tmp"})
    assert result["rc"] == 0, result
    uid, gid, groups, environment, umask, cwd, no_user_site = json.loads(result["stdout"])
    assert (uid, gid) == (ENTRY.pw_uid, ENTRY.pw_gid)
    assert set(groups) <= set(os.getgrouplist(OWNER, ENTRY.pw_gid))
    assert environment["HOME"] == ENTRY.pw_dir and environment["PATH"] == run_module.PATH
    assert environment["TMPDIR"] == "/tmp"
    assert not {"PYTHONPATH", "LD_PRELOAD"} & set(environment)
    assert (umask, cwd, no_user_site) == (0o022, "/", 1)


def test_a_forged_module_result_printed_by_the_owner_is_only_a_string():
    forged = {"changed": False, "rc": 0, "ansible_facts": {"conda_env_install_prefix": "/srv/canary"}}
    result = owner_run(["/bin/sh", "-c", f"echo '{json.dumps(forged)}'; exit 3"])
    assert "ansible_facts" not in result
    assert result["rc"] == 3 and result["failed"]
    assert json.loads(result["stdout"]) == forged
    assert set(result) <= {"rc", "stdout", "stderr", "cmd", "owner", "delta", "changed", "failed", "msg"}


def test_chdir_is_entered_by_the_owner_not_by_root(tmp_path):
    private = tmp_path / "roots"
    private.mkdir(mode=0o700)
    result = owner_run(["/bin/pwd"], chdir=str(private))
    assert result["rc"] == 126 and result["failed"]
    assert owner_run(["/bin/pwd"], chdir="/tmp")["stdout"] == "/tmp\n"


def test_a_command_past_its_time_limit_is_killed_with_its_whole_group():
    started = time.monotonic()
    # The background sleep keeps the output pipes open: the group, not just the shell, must go.
    result = owner_run(["/bin/sh", "-c", "sleep 60 & sleep 60"], timeout=1)
    assert time.monotonic() - started < 15
    assert result["timed_out"] and result["failed"] and "ran past its limit of 1 s" in result["msg"]


def test_output_is_capped_and_stripped_of_control_characters():
    result = owner_run(["/bin/sh", "-c", "printf 'ok\\033[2J\\a\\n'; head -c 300000 /dev/zero | tr '\\0' x"])
    assert result["stdout"].startswith("ok[2J\n")
    assert "\x1b" not in result["stdout"] and "\a" not in result["stdout"]
    small = owner_run(["/bin/sh", "-c", "head -c 300000 /dev/zero | tr '\\0' x"], output_limit=1000)
    assert small["stdout"] == "x" * 1000 and small["output_dropped"]["stdout"] == 299000


def test_stdin_is_given_and_closed():
    assert owner_run(["/bin/cat"], stdin="data\n")["stdout"] == "data\n"
    assert owner_run(["/bin/cat"])["stdout"] == ""


def test_check_mode_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    result = run_module.run({"owner": OWNER, "argv": ["/bin/touch", str(marker)], "_ansible_check_mode": True})
    assert result["skipped"] and not result["changed"]
    assert not marker.exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"owner": "no-such-account-p40", "argv": ["/bin/true"]}, "does not exist"),
        ({"owner": OWNER, "argv": []}, "non-empty list"),
        ({"owner": OWNER, "argv": ["/bin/true"], "environment": {"PYTHONPATH": "/x"}}, "may not set PYTHONPATH"),
        ({"owner": OWNER, "argv": ["/bin/true"], "environment": {"HOME": "/root"}}, "may not set HOME"),
        ({"owner": OWNER, "argv": ["/bin/true"], "chdir": "relative"}, "must be an absolute path"),
        ({"owner": OWNER, "argv": ["/bin/true"], "become_user": OWNER}, "unsupported option"),
    ],
)
def test_requests_outside_the_model_are_refused(arguments, message):
    with pytest.raises(run_module.Refused, match=message):
        run_module.run(arguments)


def test_stdout_dest_takes_the_whole_output_into_roots_directory_only(tmp_path):
    roots = tmp_path / "roots"
    roots.mkdir(mode=0o700)
    result = owner_run(["/bin/sh", "-c", "head -c 300000 /dev/zero"], stdout_dest=str(roots / "wheel"))
    assert result["rc"] == 0 and result["stdout"] == "" and result["stdout_written"] == 300000
    info = os.lstat(roots / "wheel")
    assert (info.st_uid, info.st_mode & 0o777, info.st_size) == (0, 0o600, 300000)
    # Too much output, or a failed command: nothing lands at the destination.
    over = owner_run(["/bin/sh", "-c", "head -c 3000 /dev/zero"], stdout_dest=str(roots / "big"), output_limit=10)
    assert over["failed"] and not (roots / "big").exists()
    assert owner_run(["/bin/false"], stdout_dest=str(roots / "f"))["failed"] and not (roots / "f").exists()
    # A directory the owner can write (or a link to one) never receives root's file.
    owned = tmp_path / "owned"
    owned.mkdir(mode=0o755)
    os.chown(owned, ENTRY.pw_uid, -1)
    with pytest.raises(run_module.Refused, match="not a directory of root's alone"):
        owner_run(["/bin/true"], stdout_dest=str(owned / "wheel"))
    os.symlink(roots, tmp_path / "link")
    with pytest.raises(run_module.Refused, match="cannot take the owner's output"):
        owner_run(["/bin/true"], stdout_dest=str(tmp_path / "link" / "wheel"))


def test_a_reported_diff_is_only_the_four_strings_of_each_entry():
    printed = {"diff": [{"before": "a\n", "after": "b\n", "before_header": "f", "ansible_facts": {"x": 1}}, "junk"]}
    arguments = {"owner": OWNER, "argv": ["/bin/cat"], "stdin": json.dumps(printed), "report_diff": True}
    result = run_module.run({**arguments, "_ansible_diff": True})
    assert result["diff"] == [{"before_header": "f", "before": "a\n", "after": "b\n"}]
    assert "diff" not in run_module.run(arguments)
    assert run_module.run({**arguments, "stdin": "not json", "_ansible_diff": True})["diff"] == []


def test_a_reported_diff_loses_the_control_characters_its_json_escapes_decode_to():
    """stdout is cleaned as text; `\\u001b` in its JSON is six printable characters there, ESC once decoded."""
    printed = {"diff": [{"before": "a\x1b]0;pwned\x07\n", "after": "b\x1b[2J\rc\n", "after_header": "\u009bf"}]}
    stdin = json.dumps(printed)
    assert "\\u001b" in stdin
    arguments = {"owner": OWNER, "argv": ["/bin/cat"], "stdin": stdin, "report_diff": True, "_ansible_diff": True}
    assert run_module.run(arguments)["diff"] == [{"after_header": "f", "before": "a]0;pwned\n", "after": "b[2Jc\n"}]


def test_through_ansible_module_stdin_never_reaches_the_result_or_the_journal_and_uid_0_is_refused(monkeypatch):
    """main() as a task runs it: stdin (a token) is masked even where the owner echoes it, the invocation holds
    neither stdin nor environment, an environment's short values are not masked in the output (a no_log dict would
    mask every "2"), nothing is logged to the host's journal, and root as the owner is refused in the module's words."""
    logged = []
    monkeypatch.setattr(run_module.AnsibleModule, "_log_invocation", lambda self: logged.append(self.params))
    token = "hf_canary_owner_run_7c2e"
    args = {"owner": OWNER, "argv": ["/bin/sh", "-c", 'cat; echo " jobs=$MAX_JOBS"'], "host": "node3"}
    result = run_module_main(run_module, {**args, "stdin": token, "environment": {"MAX_JOBS": "2"}})
    assert (result["rc"], result["stdout"]) == (0, "******** jobs=2\n"), result
    assert token not in json.dumps(result) and set(result["invocation"]["module_args"]) == set(
        run_module.ARGUMENT_SPEC
    ) - {"stdin", "environment"}
    assert logged == []
    refused = run_module_main(run_module, {**args, "owner": "root"})
    assert refused["rc"] == 1 and refused["msg"].startswith("node3: fleet_state_owner_run: the owner 'root' has uid 0")
    assert run_module_main(run_module, args, check_mode=True)["skipped"]


@pytest.mark.parametrize("name", ["root", "toor"])
def test_an_owner_of_uid_0_is_refused_under_any_name(tmp_path, monkeypatch, name):
    # `toor`: a second passwd entry of uid 0 (BSD's habit), given as the account database would; root: the real one.
    real = pwd.getpwnam
    alias = pwd.struct_passwd(("toor", "x", 0, 0, "root", "/root", "/bin/sh"))
    monkeypatch.setattr(run_module.pwd, "getpwnam", lambda account: alias if account == "toor" else real(account))
    marker = tmp_path / "ran"
    with pytest.raises(run_module.Refused, match=f"the owner '{name}' has uid 0") as refused:
        run_module.run({"owner": name, "argv": ["/bin/touch", str(marker)]})
    assert ("another name for root" in str(refused.value)) == (name == "toor")
    assert not marker.exists()


def test_only_the_controllers_tests_let_root_play_the_owner(monkeypatch):
    # The tests' seam (tests.local_hosts.ROOT_PLAYS_OWNER) is their own playbook's environment: no role, playbook or
    # plugin sets it, so on a host uid 0 is always refused.
    monkeypatch.setenv(run_module.ROOT_FOR_TESTS, "1")
    assert run_module.run({"owner": "root", "argv": ["/usr/bin/id", "-u"]})["stdout"] == "0\n"
    for tree in ("roles", "playbooks", "plugins", "owner_scripts", "molecule", "inventory"):
        for path in (REPO_ROOT / tree).rglob("*"):
            if path.is_file() and path.name != "fleet_state_owner_run.py":
                assert run_module.ROOT_FOR_TESTS not in path.read_text(errors="replace"), path
