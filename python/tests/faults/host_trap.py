#!/usr/bin/python3
"""Runs inside a sandbox host (as root) to catch one stage of a playbook run in the middle of its work.

Not a stand-in: the host's real processes run unchanged; this only watches /proc, the way a fault in the
middle of an install would strike. Usage (JSON spec as the only argument):

  {"pattern": REGEX, "until": GLOB, "unless": GLOB, "step": SECONDS, "action": "freeze"|"fill",
   "fill_path": PATH, "leave_bytes": N, "out": FILE}

It waits for a process whose command line matches `pattern`, freezes that process's whole session (the
remote side of one Ansible task: sshd starts each task's command in a session of its own; a process group is
not enough, as `timeout` moves the installer into a group of its own) and then lets it run in small steps
(`step` seconds each, default 2 ms) until `until` matches a path, so the stage is caught with part of its work
on disk.
- freeze: the session stays stopped. The controller is then killed; afterwards a file `<out>.kill` makes this
  script SIGKILL the session (the task's remote side dies with its controller), `<out>.cont` lets it go on.
- fill: fills the filesystem holding `fill_path` up to `leave_bytes` free with one file (fill_path itself),
  then lets the session go on: the stage runs out of room midway.
`out` gets a JSON report (pid, sid, command line, what was done) as soon as the session is caught; `overshot`
in it says the task got past `unless` (a glob of what only a finished stage writes) within the last step.
For freeze, the caught session is held back while it is stepped: its processes (and so their children) run at
nice 19 on the one CPU the trap itself is pinned to, so the trap's SIGSTOP comes within the step also when the
machine is busy (without it, with both cores loaded, case 3's installer once got from bin/nvcc past
version.json within one step while the trap waited for a core). The task's work is the same, only slower;
a session let go on (`<out>.cont`) stays at nice 19, which only root with CAP_SYS_NICE could undo.
"""

import contextlib
import glob
import json
import os
import re
import signal
import sys
import time

STEP = 0.002


def command_lines():
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        if raw:
            yield int(entry), raw.replace(b"\0", b" ").decode(errors="replace").strip()


def session_members(sid):
    members = []
    for pid, _ in command_lines():
        try:
            if os.getsid(pid) == sid:
                members.append(pid)
        except OSError:
            pass
    return sorted(members)


def signal_session(sid, signum):
    """Signal every process of the session; for SIGSTOP, again until no new one appeared (a fork in between).
    The processes signalled are returned (none: the session had ended)."""
    done = set()
    while True:
        members = [pid for pid in session_members(sid) if pid not in done]
        if not members:
            return done
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
            done.add(pid)
        if signum != signal.SIGSTOP:
            return done


def hold_back(pids, cpu, done):
    """Each of `pids` not in `done` at nice 19 on `cpu` alone (children inherit both)."""
    for pid in pids - done:
        done.add(pid)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(pid, {cpu})
            os.setpriority(os.PRIO_PROCESS, pid, 19)


def stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def release(sid):
    """Let the whole session go on. sudo stops itself when it sees its child stopped (to pass job control on),
    so a single SIGCONT can leave it stopped for good: continue every stopped member until none is left."""
    deadline = time.monotonic() + 5
    signal_session(sid, signal.SIGCONT)
    while time.monotonic() < deadline:
        held = [pid for pid in session_members(sid) if stopped(pid)]
        if not held:
            time.sleep(0.2)
            if not [pid for pid in session_members(sid) if stopped(pid)]:
                return
            continue
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.02)


def write(path, data):
    with open(path + ".tmp", "w") as handle:
        json.dump(data, handle)
    os.rename(path + ".tmp", path)


def fill(path, leave_bytes):
    stat = os.statvfs(os.path.dirname(path))
    size = max(stat.f_bavail * stat.f_frsize - leave_bytes, 0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
    after = os.statvfs(os.path.dirname(path))
    return size, after.f_bavail * after.f_frsize


def main(spec):
    pattern = re.compile(spec["pattern"])
    me = os.getpid()
    while True:
        found = [(pid, line) for pid, line in command_lines() if pid != me and pattern.search(line)]
        if found:
            break
        time.sleep(STEP)
    pid, line = found[0]
    sid = os.getsid(pid)
    stopped_pids = signal_session(sid, signal.SIGSTOP)
    held = spec["action"] == "freeze"
    if held:
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        held_pids = set()
        hold_back(stopped_pids, cpu, held_pids)
    steps, step = 0, spec.get("step", STEP)
    while spec.get("until") and not glob.glob(spec["until"]):
        # Step the frozen task forward until its work reaches the point the case is about.
        if not signal_session(sid, signal.SIGCONT):
            write(spec["out"], {"pid": pid, "sid": sid, "cmdline": line, "error": "the task ended first"})
            return 1
        time.sleep(step)
        stopped_pids = signal_session(sid, signal.SIGSTOP)
        if held:
            hold_back(stopped_pids, cpu, held_pids)  # one started meanwhile: not all are children of held ones
        steps += 1
    report = {
        "pid": pid,
        "sid": sid,
        "cmdline": line,
        "steps": steps,
        "members": session_members(sid),
        "overshot": bool(spec.get("unless") and glob.glob(spec["unless"])),
    }
    if spec["action"] == "fill":
        report["filled_bytes"], report["free_bytes"] = fill(spec["fill_path"], spec.get("leave_bytes", 0))
        release(sid)
        write(spec["out"], report)
        return 0
    write(spec["out"], report)
    while True:
        if os.path.exists(spec["out"] + ".kill"):
            signal_session(sid, signal.SIGKILL)
            for _ in range(100):
                if not session_members(sid):
                    break
                time.sleep(0.05)
            write(spec["out"] + ".done", {"left": session_members(sid)})
            return 0
        if os.path.exists(spec["out"] + ".cont"):
            release(sid)
            write(spec["out"] + ".done", {"continued": True})
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
