#!/usr/bin/python3
"""Root's one way to have the env owner run something: a child process of the owner, whose output is data.

A task with `become_user: <owner>` runs its Ansible module in the system Python as the owner, which imports the
owner's ~/.local usercustomize and .pth files: the owner can then rewrite the module's JSON result, ansible_facts
included, and Ansible trusts it as a fact (docs/privileges.md). This module runs as root instead, in root's Python, and
starts the command as a child with the owner's uid, primary group and supplementary groups (initgroups), a clean
environment (the system PATH unless the task sets its own, HOME from the account database, no PYTHON* variable
but PYTHONNOUSERSITE=1 for Pythons started through a shebang; a Python the task starts itself takes -I), umask
022 unless asked, its own session (the whole process group is killed at the time limit) and `chdir` entered by
the owner, after the switch. Only rc, stdout and stderr come back, each capped in size and stripped of control
characters: strings in a result root builds, never facts, never a module result the owner wrote.

An AnsibleModule with an argument_spec (docs/extending-modules.md). `stdin` (a token, git credentials) is a no_log
option: Ansible masks its text wherever it appears in the result. `environment` is not, as Ansible would mask each of
its values (a "2", a "/usr/bin") in every output string; it is kept out of the result's invocation instead, as stdin
is, and the module is no_log=True, so the invocation is never written to the host's journal.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import selectors
import signal
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: fleet_state_owner_run
short_description: Run a command as the env owner in a child process with a clean environment; rc and output back.
description:
  - Runs a command as the env owner in a child process with a clean environment and returns its rc and output.
  - Root never reads a path the owner chose; output past O(output_limit) is read and dropped.
author: p40fleet
options:
  owner:
    description: The account that runs the command (the env owner); uid 0, under any name, is refused.
    type: str
    required: true
  argv:
    description: The command and its arguments (no shell unless argv names one).
    type: list
    required: true
  chdir:
    description: Directory the command starts in, entered by the owner after the switch.
    type: str
  environment:
    description: Variables over the clean base (PATH among them); HOME, USER, LOGNAME, SHELL and PYTHON* are refused.
    type: dict
  stdin:
    description: Text written to the command's standard input (closed after it).
    type: str
    default: ""
  timeout:
    description: Seconds before the command's whole process group is killed and the task fails.
    type: int
    default: 3600
  output_limit:
    description: Bytes of stdout kept (the first) and of stderr kept (the last); the rest is read and dropped.
    type: int
    default: 1048576
  stdout_dest:
    description: >-
      A file in a directory of root's alone (root-owned, writable by nobody else) that receives the whole stdout
      (up to output_limit), for bytes root copies on (a built wheel): written to a new file there and renamed
      into place, never through a link; the result's stdout is then empty.
    type: str
  report_diff:
    description: >-
      Under --diff, the command's stdout is JSON whose "diff" list (before, after and their headers, strings only)
      is shown as the task's diff: the owner's text reported, never acted on.
    type: bool
    default: false
  umask:
    description: Octal umask of the command.
    type: str
    default: "0022"
  host:
    description: The host's inventory name, for messages.
    type: str
    default: this host
"""

EXAMPLES = r"""
- name: Ask the env's Python for its version, as the env owner
  p40fleet.fleet.fleet_state_owner_run:
    owner: p40fleet
    argv: [/opt/p40fleet/conda/bin/python, -I, -c, "import sys; print(sys.version)"]
    timeout: 60
  register: owner_python
"""

RETURN = r"""
rc:
  description: The command's exit status.
  type: int
  returned: always
stdout:
  description: The command's standard output (the first O(output_limit) bytes; empty with O(stdout_dest)).
  type: str
  returned: always
stderr:
  description: The command's standard error (the last O(output_limit) bytes).
  type: str
  returned: always
cmd:
  description: The command as given.
  type: list
  elements: str
  returned: always
"""

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# PATH may be set by the task (a build's compilers first), from root's own variables; who the child is may not.
FIXED = ("HOME", "USER", "LOGNAME", "SHELL")
# Tabs and newlines stay; every other control character (terminal escapes among them) goes.
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")
# Enters chdir as the owner: a link the owner planted leads only where the owner could go anyway.
CHDIR = 'cd -- "$1" || exit 126; shift; exec "$@"'
# Set only by tests that run a role on the controller as root playing the owner (the interpreter they need lies in
# root's 0700 home, which no other account can run): their own ansible-playbook's environment, never a role's task.
ROOT_FOR_TESTS = "P40FLEET_TEST_ROOT_PLAYS_OWNER"


class Refused(Exception):
    """A request this module does not run: the message names what is wrong."""


def options(arguments: dict) -> dict:
    known = {"owner", "argv", "chdir", "environment", "stdin", "timeout", "output_limit", "umask", "host"}
    known.update(("stdout_dest", "report_diff"))
    unknown = sorted(key for key in arguments if not key.startswith("_ansible_") and key not in known)
    if unknown:
        raise Refused(f"unsupported option(s) {', '.join(unknown)}; supported: {', '.join(sorted(known))}")
    owner = arguments.get("owner")
    if not isinstance(owner, str) or not owner:
        raise Refused("option owner is required")
    argv = arguments.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(item, (str, int, float)) for item in argv):
        raise Refused("option argv must be a non-empty list of strings")
    environment = arguments.get("environment") or {}
    if not isinstance(environment, dict):
        raise Refused("option environment must be a dict")
    for key in environment:
        if key in FIXED or str(key).startswith("PYTHON"):
            raise Refused(f"option environment may not set {key}: the owner's environment is fixed")
    try:
        umask = int(str(arguments.get("umask") or "0022"), 8)
        timeout = int(arguments.get("timeout") or 3600)
        limit = int(arguments.get("output_limit") or 1048576)
    except ValueError as error:
        raise Refused(f"bad umask, timeout or output_limit: {error}") from None
    chdir = arguments.get("chdir")
    if chdir is not None and (not isinstance(chdir, str) or not chdir.startswith("/")):
        raise Refused(f"option chdir must be an absolute path, got {chdir!r}")
    dest = arguments.get("stdout_dest")
    if dest is not None and (not isinstance(dest, str) or not dest.startswith("/") or dest.endswith("/")):
        raise Refused(f"option stdout_dest must be an absolute file path, got {dest!r}")
    return {
        "dest": dest,
        "owner": owner,
        "argv": [str(item) for item in argv],
        "chdir": chdir,
        "environment": {str(k): str(v) for k, v in environment.items()},
        "stdin": str(arguments.get("stdin") or ""),
        "timeout": timeout,
        "limit": limit,
        "umask": umask,
    }


def open_roots_directory(path: str) -> int:
    """The directory for stdout_dest, opened without following a last link, and only if it is root's alone."""
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as error:
        raise Refused(f"{os.path.dirname(path)} cannot take the owner's output: {error}") from None
    info = os.fstat(fd)
    if info.st_uid != 0 or info.st_mode & 0o022:
        os.close(fd)
        raise Refused(
            f"{os.path.dirname(path)} is not a directory of root's alone (uid {info.st_uid}, "
            f"mode {info.st_mode & 0o7777:04o}): the owner's output is written only there"
        )
    return fd


def account(name: str) -> pwd.struct_passwd:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise Refused(f"the account {name!r} does not exist") from None
    # The module exists to drop root's power: an owner of uid 0 (root, or another name for it) would run the owner's
    # files (an env's Python, its .pth hooks) with root's, whatever the caller checked.
    if entry.pw_uid == 0 and os.environ.get(ROOT_FOR_TESTS) != "1":
        alias = "" if entry.pw_name == "root" else " (another name for root)"
        raise Refused(
            f"the owner {name!r} has uid 0{alias}: this module runs the env owner's commands with the owner's "
            f"rights alone, never root's; set the owner to the unprivileged account that owns the tree"
        )
    return entry


def clean_environment(entry: pwd.struct_passwd, extra: dict) -> dict:
    base = {
        "PATH": PATH,
        "HOME": entry.pw_dir,
        "USER": entry.pw_name,
        "LOGNAME": entry.pw_name,
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # conda's and pip's entry scripts start Python through a shebang, where -I cannot be passed.
        "PYTHONNOUSERSITE": "1",
    }
    return {**base, **extra}


def clean_text(data: bytes) -> str:
    return CONTROL.sub("", data.decode("utf-8", errors="replace"))


def execute(params: dict) -> dict:
    entry = account(params["owner"])
    argv = params["argv"]
    if params["chdir"]:
        argv = ["/bin/sh", "-c", CHDIR, "sh", params["chdir"], *argv]
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    sink = None
    if params["dest"]:
        dest_dir = open_roots_directory(params["dest"])
        temp = f".{os.path.basename(params['dest'])}.p40fleet-{os.getpid()}"
        sink = os.fdopen(
            os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dest_dir), "wb"
        )
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=clean_environment(entry, params["environment"]),
            cwd="/",
            user=entry.pw_uid,
            group=entry.pw_gid,
            extra_groups=groups,
            umask=params["umask"],
            start_new_session=True,
            close_fds=True,
        )
    except OSError as error:
        raise Refused(f"could not start {argv[0]} as {entry.pw_name}: {error}") from None
    limit, out, err = params["limit"], bytearray(), bytearray()
    out_dropped = err_dropped = out_written = 0
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ, "out")
    selector.register(child.stderr, selectors.EVENT_READ, "err")
    with contextlib.suppress(BrokenPipeError):
        child.stdin.write(params["stdin"].encode())
    with contextlib.suppress(BrokenPipeError):
        child.stdin.close()
    deadline = started + params["timeout"]
    timed_out = False
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in selector.select(min(remaining, 5)):
            chunk = os.read(key.fileobj.fileno(), 65536)
            if not chunk:
                selector.unregister(key.fileobj)
                continue
            if key.data == "out" and sink is not None:
                keep = max(0, min(len(chunk), limit - out_written))
                sink.write(chunk[:keep])
                out_written += keep
                out_dropped += len(chunk) - keep
            elif key.data == "out":
                keep = max(0, min(len(chunk), limit - len(out)))
                out += chunk[:keep]
                out_dropped += len(chunk) - keep
            else:
                err += chunk
                if len(err) > limit:
                    err_dropped += len(err) - limit
                    del err[: len(err) - limit]
    if timed_out:
        kill_group(child)
    try:
        rc = child.wait(timeout=max(1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_group(child)
        rc = child.wait()
    selector.close()
    child.stdout.close()
    child.stderr.close()
    if sink is not None:
        sink.close()
        temp = f".{os.path.basename(params['dest'])}.p40fleet-{os.getpid()}"
        try:
            if rc == 0 and not timed_out and not out_dropped:
                os.rename(temp, os.path.basename(params["dest"]), src_dir_fd=dest_dir, dst_dir_fd=dest_dir)
            else:
                os.unlink(temp, dir_fd=dest_dir)
        finally:
            os.close(dest_dir)
    result = {
        "rc": rc,
        "stdout": clean_text(bytes(out)),
        "stderr": clean_text(bytes(err)),
        "cmd": params["argv"],
        "owner": entry.pw_name,
        "delta": round(time.monotonic() - started, 3),
        "changed": True,
    }
    if sink is not None:
        result["stdout_written"] = out_written
    if out_dropped or err_dropped:
        result["output_dropped"] = {"stdout": out_dropped, "stderr": err_dropped}
        if sink is not None:
            result["failed"] = True
            result["msg"] = f"the output of {params['argv'][0]} passed output_limit: {params['dest']} was not written"
    if timed_out:
        result["failed"] = True
        result["timed_out"] = True
        result["msg"] = f"{params['argv'][0]} as {entry.pw_name} ran past its limit of {params['timeout']} s: killed"
    elif rc != 0:
        result["failed"] = True
        result["msg"] = f"{params['argv'][0]} as {entry.pw_name} exited with rc {rc}"
    return result


def kill_group(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)


def run(arguments: dict) -> dict:
    """The module's result for its arguments: only what root built from the child's rc and output."""
    params = options(arguments)
    if arguments.get("_ansible_check_mode"):
        # A dry run on a fresh host may only have pretended to make the owner: nothing is asked of it.
        return {"changed": False, "skipped": True, "msg": "the owner's command would run if not in check mode"}
    result = execute(params)
    if arguments.get("report_diff") and arguments.get("_ansible_diff") and result["rc"] == 0:
        result["diff"] = reported_diff(result["stdout"])
    return result


def reported_diff(stdout: str) -> list[dict]:
    """The diff entries the owner's command printed, each reduced to its four strings, for display only."""
    try:
        entries = json.loads(stdout).get("diff") or []
    except (ValueError, AttributeError):
        return []
    keys = ("before_header", "after_header", "before", "after")
    # stdout was cleaned as text, but JSON escapes (`\u001b`) decode to control characters: cleaned again here.
    return [
        {key: CONTROL.sub("", entry[key]) for key in keys if isinstance(entry.get(key), str)}
        for entry in entries[:100]
        if isinstance(entry, dict)
    ]


# Types and defaults; what a value must be beyond its type (owner's uid, chdir and stdout_dest absolute, environment's
# names) is options()'s, with the module's own words.
ARGUMENT_SPEC = {
    "owner": {"type": "str", "required": True},
    "argv": {"type": "list", "required": True},
    "chdir": {"type": "str"},
    "environment": {"type": "dict", "no_log": False},
    "stdin": {"type": "str", "default": "", "no_log": True},
    "timeout": {"type": "int", "default": 3600},
    "output_limit": {"type": "int", "default": 1048576},
    "stdout_dest": {"type": "str"},
    "report_diff": {"type": "bool", "default": False},
    "umask": {"type": "str", "default": "0022"},
    "host": {"type": "str", "default": "this host"},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True, no_log=True)
    arguments = {k: v for k, v in module.params.items() if v is not None}
    arguments.update(_ansible_check_mode=module.check_mode, _ansible_diff=module._diff)
    shown = {k: v for k, v in module.params.items() if k not in ("stdin", "environment")}
    try:
        result = run(arguments)
    except Refused as error:
        module.fail_json(
            msg=f"{module.params['host']}: fleet_state_owner_run: {error}", invocation={"module_args": shown}
        )
    result["invocation"] = {"module_args": shown}
    if result.get("failed"):
        module.fail_json(**result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
