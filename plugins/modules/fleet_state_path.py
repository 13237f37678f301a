#!/usr/bin/python3
"""Root's one way to make a directory or write a file where the env owner could interfere (the privilege model).

Every role asks this module, run as root, for a root-owned directory (state directory, staging), a directory the
env owner owns (data, checkouts, wheels), a file written into either tree, or a file removed from it. It walks
the path from / one component at a time through directory file descriptors, never following a link the env
owner (or any account but root) could have made, and refuses, naming the host, the path and what it found, when:

- a component is a symlink that is not root's own in a directory only root can write, or is not a directory;
- a directory is writable by an account other than root and the env owner (group or other writable without the
  sticky bit), or is owned by such an account;
- a root-owned directory is asked for where the env owner controls the parent, or one already exists owned by
  someone else (a /var/tmp/p40fleet made first by another account);
- a directory for the env owner already exists and belongs to root: root hands over only what it made in this
  call, never an existing directory with whatever is in it (a forged path pointing at /srv or /etc);
- a file's destination is a symlink, a FIFO, a directory or anything but a regular file;
- a path to remove lies behind a link the owner could have made (an `envs/` swapped for a link to /etc): the
  walk refuses it before anything is removed, and a tree (recurse) is removed through descriptors only.

What it writes goes to a new file in the opened parent directory (O_EXCL, O_NOFOLLOW), is chowned and chmoded
through its descriptor and renamed over the destination: a link planted at the last moment is replaced, never
followed. `batch` makes a tree in one call (one round trip, where a loop made one per path): each item is a request
of its own, its options over the task's, checked and acted on in order as if it were a task; the first refusal
stops the batch. In diff mode (`--diff`, with `--check` too) a file's result carries a diff of its content
as ansible.builtin.copy's does, the values of a `secret` file masked.

An AnsibleModule with an argument_spec (docs/extending-modules.md), with three of the library's habits turned off, each
for a reason: a result's `path` is not stat-ed for file facts (add_path_info follows the very links the walk
refused, and would report what a planted link points at); the invocation is not written to the host's journal
(no_log=True: a batch's or a file's content may be a credential); and content is not a no_log option, since
Ansible would mask every occurrence of its text in the result, diffs and paths included; it is kept out of the
result's invocation instead, and a `secret` file's diff is masked here.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pwd
import re
import shutil
import stat
import sys

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: fleet_state_path
short_description: Make a directory or write or remove a file as root, refusing any path the env owner could steer.
description:
  - Makes a directory, or writes or removes a file, as root, refusing any path the env owner could steer.
  - Every component is opened without following links; a file's change is shown as a diff with secrets masked.
author: p40fleet
options:
  path:
    description: >-
      Absolute path of the directory or file, walked as given (no ~ or variable expansion); required unless
      O(batch) is given.
    type: str
  state:
    description: directory, file (write content) or absent (remove a file; a directory's tree only with recurse).
    type: str
    choices: [directory, file, absent]
    default: directory
  owner:
    description: Who owns the directory or file (root, or the env owner).
    type: str
    default: root
  trusted_owner:
    description: >-
      The env owner: directories it owns may be walked through (their entries are then only ever opened without
      following links). Every other non-root account is trusted with nothing.
    type: str
    default: root
  mode:
    description: Octal mode, e.g. "0755"; required unless O(state=absent).
    type: str
  content:
    description: The file's content (state file); never logged.
    type: str
  content_base64:
    description: The file's content, base64 (state file), for bytes that are not text.
    type: str
  recurse:
    description: >-
      With state absent, a directory found at the path is removed with everything in it, through descriptors
      (no link inside is followed; a link at the path itself is removed, not its target).
    type: bool
    default: false
  reclaim:
    description: >-
      A root-owned directory found owned by the trusted owner (left so by an earlier p40fleet) is taken back for
      root instead of refused. Only for directories root made itself.
    type: bool
    default: false
  secret:
    description: >-
      The content is secret (credentials, tokens): in diff mode its diff shows the file's shape only (comments,
      section headers and the names it sets, each value masked), never a value.
    type: bool
    default: false
  host:
    description: The host's inventory name, for messages.
    type: str
    default: this host
  batch:
    description: >-
      Requests acted on in order, each a dict of the options above over the task's own (path, state, mode,
      content...) or a path (the task's options), instead of the task's path. The first refusal stops the batch;
      what came before it stays done.
    type: list
    elements: raw
"""

EXAMPLES = r"""
- name: Ensure the state directory exists, root's own
  p40fleet.fleet.fleet_state_path:
    path: /var/lib/p40fleet
    state: directory
    owner: root
    mode: "0755"
"""

RETURN = r"""
path:
  description: The path acted on.
  type: str
  returned: always
diff:
  description: The file's content before and after (secrets masked), where Ansible asks for a diff.
  type: dict
  returned: when diff mode is on and O(state=file)
"""

FOLLOW_LIMIT = 40
# Larger contents are named, not shown, in a diff (Ansible's own default for copy and template).
DIFF_LIMIT = 104448
MASK = "********"
# A line that sets a name: `export NAME=value` (an .env), `name = value` (pip.conf), `name: value` (YAML).
SETTING = re.compile(r"^(\s*(?:export\s+)?[A-Za-z_][\w.-]*\s*[=:]\s*)(.*)$")


class Refused(Exception):
    """A path root must not act on: the message names what was found and what to do."""


class Missing(Refused):
    """A parent that does not exist yet (in check mode: one an earlier task of the run would have made)."""


def describe(info: os.stat_result, name: str = "") -> str:
    """What a path is, for a message: its type, owner and mode."""
    try:
        owner = pwd.getpwuid(info.st_uid).pw_name
    except KeyError:
        owner = f"uid {info.st_uid}"
    kind = (
        "a symlink"
        if stat.S_ISLNK(info.st_mode)
        else "a directory"
        if stat.S_ISDIR(info.st_mode)
        else "a regular file"
        if stat.S_ISREG(info.st_mode)
        else "a FIFO"
        if stat.S_ISFIFO(info.st_mode)
        else "a special file"
    )
    return f"{kind} owned by {owner}, mode {stat.S_IMODE(info.st_mode):04o}"


def authority(info: os.stat_result, trusted_uid: int) -> str:
    """Who can change a directory's entries: root (root alone), sticky (root-owned, world-writable with the
    sticky bit: only root's own entries are root's), owner (the trusted owner) or other (anyone else)."""
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid == 0 and not mode & 0o022:
        return "root"
    if info.st_uid == 0 and mode & stat.S_ISVTX:
        return "sticky"
    if info.st_uid == trusted_uid and trusted_uid != 0 and not mode & 0o022:
        return "owner"
    return "other"


def child_authority(parent: str, info: os.stat_result, trusted_uid: int) -> str:
    """The authority over a directory reached from a parent of the given authority."""
    own = authority(info, trusted_uid)
    if own == "other":
        return "other"
    if parent == "root":
        return own
    if parent == "sticky":
        # Anyone can make an entry in a sticky directory first: only root's own entries are root's.
        return own if info.st_uid == 0 else "other"
    # Under the owner's directory the owner can rename anything in place: nothing below is more than the owner's.
    return "owner"


def split(path: str) -> list[str]:
    if not os.path.isabs(path):
        raise Refused(f"{path} is not an absolute path")
    parts = [part for part in path.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise Refused(f"{path} has a '..' component")
    return parts


def open_parent(path: str, trusted_uid: int) -> tuple[int, str, str, str]:
    """Open the directory holding path's last component, checking every component from / on the way.

    Returns (fd, last name, authority over that directory, the real path walked). Root-owned links in
    directories only root can write (an administrator's, such as /var/run) are followed and checked in turn."""
    parts = split(path)
    if not parts:
        raise Refused("/ is not a path p40fleet manages")
    follows = 0
    while True:
        fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY)
        walked, level, restart = "", "root", None
        try:
            for index, name in enumerate(parts[:-1]):
                here = f"{walked}/{name}"
                try:
                    info = os.lstat(name, dir_fd=fd)
                except FileNotFoundError:
                    raise Missing(f"{here} does not exist (its parent of {path} must be made first)") from None
                if stat.S_ISLNK(info.st_mode):
                    if level != "root" or info.st_uid != 0 or follows >= FOLLOW_LIMIT:
                        raise Refused(f"{here} is {describe(info)} to {os.readlink(name, dir_fd=fd)}")
                    follows += 1
                    target = os.readlink(name, dir_fd=fd)
                    base = target if target.startswith("/") else f"{walked}/{target}"
                    restart = [*split(os.path.normpath(base)), *parts[index + 1 :]]
                    break
                if not stat.S_ISDIR(info.st_mode):
                    raise Refused(f"{here} is {describe(info)}, not a directory")
                level = child_authority(level, info, trusted_uid)
                if level == "other":
                    raise Refused(f"{here} is {describe(info)}: an account root does not trust can change it")
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                opened = os.fstat(child)
                os.close(fd)
                fd = child
                if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                    raise Refused(f"{here} changed while it was being checked")
                walked = here
        except BaseException:
            os.close(fd)
            raise
        if restart is None:
            return fd, parts[-1], level, f"{walked}/{parts[-1]}"
        os.close(fd)
        parts = restart


def found_at(fd: int, name: str, info: os.stat_result) -> str:
    """What a directory entry is, a link with its target."""
    text = describe(info)
    return f"{text} to {os.readlink(name, dir_fd=fd)}" if stat.S_ISLNK(info.st_mode) else text


def lstat_at(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=fd)
    except FileNotFoundError:
        return None


def masked(text: str) -> str:
    """A secret file's shape, never a value: comments, blank lines, section headers and names that set nothing as
    they are, a setting's name with its value masked, any other line masked after its indent."""
    lines = []
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        end, stripped = line[len(body) :], body.strip()
        setting = SETTING.match(body)
        if not stripped or stripped.startswith("#") or (stripped.startswith("[") and stripped.endswith("]")):
            lines.append(line)
        elif setting:
            lines.append(f"{setting.group(1)}{MASK if setting.group(2) else ''}{end}")
        else:
            lines.append(f"{body[: len(body) - len(body.lstrip())]}{MASK}{end}")
    return "".join(lines)


def shown(data: bytes | None, secret: bool) -> str:
    """A file's content as a diff shows it: text (masked when secret), or a line naming what is not shown."""
    if data is None:
        return ""
    if len(data) > DIFF_LIMIT:
        return f"(content of {len(data)} bytes, over the {DIFF_LIMIT}-byte diff limit, not shown)\n"
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return f"(binary content, {len(data)} bytes)\n"
    if "\0" in text:
        return f"(binary content, {len(data)} bytes)\n"
    return masked(text) if secret else text


def file_diff(path: str, before: bytes | None, after: bytes, secret: bool, modes: tuple[str, str]) -> dict:
    """The diff of a file's content as Ansible shows it (before/after with headers, as ansible.builtin.copy
    returns). `before` is None for a file that does not exist yet; modes are (before, after), shown in the headers
    where they differ."""
    note = " (secret: values masked)" if secret else ""
    old_mode, new_mode = modes
    return {
        "before_header": f"{path}{note}" if before is not None else f"{path} (absent)",
        "after_header": f"{path}{note}" + (f" (mode {old_mode} -> {new_mode})" if old_mode != new_mode else ""),
        "before": shown(before, secret),
        "after": shown(after, secret),
    }


def ensure_directory(params: dict, uid: int, trusted_uid: int, check_mode: bool) -> dict:
    path, mode = params["path"], params["mode"]
    fd, name, level, real = open_parent(path, trusted_uid)
    try:
        if uid == 0 and level not in ("root", "sticky"):
            raise Refused(f"{real}: root's directory would be made in one the env owner controls ({level})")
        info = lstat_at(fd, name)
        changed = info is None
        if info is None:
            if check_mode:
                return {"changed": True, "path": real}
            # A sticky parent: someone may make the name first; mkdir then fails and nothing is followed.
            os.mkdir(name, 0o700, dir_fd=fd)
            info = os.lstat(name, dir_fd=fd)
        if not stat.S_ISDIR(info.st_mode):
            raise Refused(f"{real} is {found_at(fd, name, info)}, not a directory")
        wanted, group = uid, gid_of(uid)
        if uid == 0 and not changed and stat.S_IMODE(info.st_mode) & 0o022 and not params["reclaim"]:
            # Whoever could write it may have left anything inside.
            raise Refused(f"{real} is {describe(info)}: writable by accounts other than root")
        if info.st_uid != uid:
            # Root hands the owner only the directory it made just now: an existing root directory (/srv, /etc,
            # or one whose contents root relies on) given away would be the owner's with everything in it. An
            # earlier p40fleet's owner directory is taken back for root only when asked (reclaim).
            handed = uid != 0 and info.st_uid == 0 and changed
            reclaimed = uid == 0 and params["reclaim"] and info.st_uid == trusted_uid and level == "root"
            if uid != 0 and info.st_uid == 0 and not changed:
                raise Refused(
                    f"{real} is {found_at(fd, name, info)}, where a directory owned by {params['owner']} belongs; "
                    f"root gives {params['owner']} only a directory it makes itself, never one that exists. "
                    f"If it is meant for {params['owner']}, move it aside or chown it to {params['owner']} yourself"
                )
            if not (handed or reclaimed):
                raise Refused(
                    f"{real} is {found_at(fd, name, info)}, where a directory owned by {params['owner']} belongs"
                )
        target = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        try:
            opened = os.fstat(target)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise Refused(f"{real} changed while it was being checked")
            if (opened.st_uid, opened.st_gid) != (wanted, group):
                changed = True
                if not check_mode:
                    os.fchown(target, wanted, group)
            if stat.S_IMODE(opened.st_mode) != mode:
                changed = True
                if not check_mode:
                    os.fchmod(target, mode)
        finally:
            os.close(target)
        return {"changed": changed, "path": real}
    finally:
        os.close(fd)


def ensure_file(params: dict, uid: int, trusted_uid: int, check_mode: bool) -> dict:
    path, mode, data = params["path"], params["mode"], params["data"]
    fd, name, _, real = open_parent(path, trusted_uid)
    try:
        info = lstat_at(fd, name)
        before, old_mode = None, f"{mode:04o}"
        if info is not None:
            if not stat.S_ISREG(info.st_mode) or info.st_uid not in (0, uid):
                raise Refused(
                    f"{real} is {found_at(fd, name, info)}, where a regular file owned by {params['owner']} belongs"
                )
            current = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            with os.fdopen(current, "rb") as handle:
                opened = os.fstat(handle.fileno())
                # Only a regular file is read (a FIFO swapped in after the lstat would block); in diff mode up to
                # the diff limit, so that the diff shows what is there.
                if stat.S_ISREG(opened.st_mode):
                    before = handle.read(max(len(data), DIFF_LIMIT if params["diff"] else 0) + 1)
                old_mode = f"{stat.S_IMODE(opened.st_mode):04o}"
                same = (
                    stat.S_ISREG(opened.st_mode)
                    and opened.st_uid == uid
                    and stat.S_IMODE(opened.st_mode) == mode
                    and opened.st_size == len(data)
                    and before == data
                )
            if same:
                return {"changed": False, "path": real}
        result = {"changed": True, "path": real}
        if params["diff"]:
            result["diff"] = file_diff(real, before, data, params["secret"], (old_mode, f"{mode:04o}"))
        if check_mode:
            return result
        temp = f".{name}.p40fleet-{os.getpid()}"
        handle_fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
        try:
            with os.fdopen(handle_fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fchown(handle.fileno(), uid, gid_of(uid))
                os.fchmod(handle.fileno(), mode)
                os.fsync(handle.fileno())
            os.rename(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=fd)
            raise
        return result
    finally:
        os.close(fd)


# shutil.rmtree takes dir_fd from Python 3.11 on; the hosts' Pythons before it get remove_tree_at's own walk.
RMTREE_DIR_FD = sys.version_info >= (3, 11) and shutil.rmtree.avoids_symlink_attacks


def remove_tree_at(parent_fd: int, name: str, shown_as: str) -> None:
    """Remove the directory `name` of parent_fd and all below it without following a link: every directory below is
    opened with O_NOFOLLOW and checked to be the one listed, entries removed relative to it, so a link the owner swaps
    in mid-removal leads nowhere. shutil.rmtree(name, dir_fd=...) does so from Python 3.11; the hosts' Pythons before
    it (Debian 11's 3.9, Ubuntu 22.04's 3.10) get the same walk here."""
    if RMTREE_DIR_FD:
        shutil.rmtree(name, dir_fd=parent_fd)
        return
    listed = os.lstat(name, dir_fd=parent_fd)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        raise Refused(f"{shown_as}: cannot be opened as a directory without following a link ({error})") from None
    try:
        if not os.path.samestat(listed, os.fstat(fd)):
            raise Refused(f"{shown_as}: changed while it was being removed")
        with os.scandir(fd) as entries:
            found = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
        for entry, is_dir in found:
            if is_dir:
                remove_tree_at(fd, entry, f"{shown_as}/{entry}")
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def ensure_absent(params: dict, uid: int, trusted_uid: int, check_mode: bool) -> dict:
    try:
        fd, name, _, real = open_parent(params["path"], trusted_uid)
    except Missing:
        # A parent that does not exist holds no file.
        return {"changed": False, "path": params["path"]}
    try:
        info = lstat_at(fd, name)
        if info is None:
            return {"changed": False, "path": real}
        if stat.S_ISDIR(info.st_mode):
            if not params["recurse"]:
                raise Refused(f"{real} is {describe(info)}, where a file was to be removed")
            if not check_mode:
                remove_tree_at(fd, name, real)
            return {"changed": True, "path": real}
        # unlink removes the name, never what a link points at.
        if not check_mode:
            os.unlink(name, dir_fd=fd)
        return {"changed": True, "path": real}
    finally:
        os.close(fd)


STATES = {"directory": ensure_directory, "file": ensure_file, "absent": ensure_absent}
OPTIONS = {
    "path": ((str,), None),
    "state": ((str,), "directory"),
    "owner": ((str,), "root"),
    "trusted_owner": ((str,), "root"),
    "mode": ((str, type(None)), None),
    "content": ((str, type(None)), None),
    "content_base64": ((str, type(None)), None),
    "reclaim": ((bool,), False),
    "recurse": ((bool,), False),
    "secret": ((bool,), False),
    "host": ((str,), "this host"),
}


def gid_of(uid: int) -> int:
    """The primary group of an account (root's is 0)."""
    return 0 if uid == 0 else pwd.getpwuid(uid).pw_gid


def uid_of(name: str) -> int:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        raise Refused(f"the account {name!r} does not exist") from None


def options(arguments: dict) -> dict:
    """The task's options with their defaults; a bad option is a ValueError naming it."""
    unknown = sorted(key for key in arguments if not key.startswith("_ansible_") and key not in OPTIONS)
    if unknown:
        raise ValueError(f"unsupported option(s) {', '.join(unknown)}; supported: {', '.join(OPTIONS)}")
    params = {}
    for key, (types, default) in OPTIONS.items():
        value = arguments.get(key)
        value = default if value is None else value
        if value is not None and not isinstance(value, types):
            raise ValueError(f"option {key} must be {' or '.join(t.__name__ for t in types)}, got {value!r}")
        params[key] = value
    # Ansible's --diff, passed to every module: a written file's result then carries its diff.
    params["diff"] = bool(arguments.get("_ansible_diff"))
    if not params["path"]:
        raise ValueError("option path is required")
    if params["state"] not in STATES:
        raise ValueError(f"option state must be one of {', '.join(STATES)}, got {params['state']!r}")
    if params["state"] != "absent":
        try:
            params["mode"] = int(params["mode"] or "", 8)
        except ValueError:
            raise ValueError(f"option mode must be an octal mode like 0755, got {params['mode']!r}") from None
    if params["state"] == "file":
        if (params["content"] is None) == (params["content_base64"] is None):
            raise ValueError("state file needs exactly one of content and content_base64")
        params["data"] = (
            params["content"].encode() if params["content"] is not None else base64.b64decode(params["content_base64"])
        )
    return params


def would_make(params: dict) -> dict:
    """A dry run's result for a path whose parent or owner an earlier task of the run would make."""
    result = {"changed": True, "path": params["path"]}
    if params["diff"] and params["state"] == "file":
        mode = f"{params['mode']:04o}"
        result["diff"] = file_diff(params["path"], None, params["data"], params["secret"], (mode, mode))
    return result


def run(params: dict, check_mode: bool) -> dict:
    try:
        uid = uid_of(params["owner"])
    except Refused:
        if check_mode and params["owner"] == params["trusted_owner"]:
            # The env owner that an earlier task of this run makes (conda_env): a dry run only pretended to make
            # it, so its paths are ones the run would make. A real run without the account still refuses.
            return would_make(params)
        raise
    try:
        trusted = uid_of(params["trusted_owner"])
    except Refused:
        # Not made yet (conda_env makes it, after the stages that stage root's downloads): nobody is trusted.
        trusted = -1
    if uid not in (0, trusted):
        raise Refused(f"{params['path']} would belong to {params['owner']}, who is neither root nor the env owner")
    try:
        return STATES[params["state"]](params, uid, trusted, check_mode)
    except Missing:
        if check_mode:
            return would_make(params)
        raise


class BatchItemFailed(Exception):
    """A batch item's bad option or OS error, with the path it was for."""

    def __init__(self, path: object, error: Exception) -> None:
        super().__init__(str(error))
        self.path = path


def run_batch(arguments: dict, check_mode: bool) -> dict:
    """Each item of `batch` as its own request, its options over the task's; the first refusal or error stops it."""
    items = arguments["batch"]
    if not isinstance(items, list):
        raise ValueError("option batch must be a list of paths or dicts of this module's options")
    # A plain path is a request with the task's options.
    items = [{"path": item} if isinstance(item, str) else item for item in items]
    if not all(isinstance(item, dict) and "batch" not in item for item in items):
        raise ValueError("option batch must be a list of paths or dicts of this module's options (no batch inside)")
    common = {key: value for key, value in arguments.items() if key != "batch"}
    results = []
    for item in items:
        try:
            results.append(run(options({**common, **item}), check_mode))
        except (ValueError, OSError) as error:
            raise BatchItemFailed(item.get("path"), error) from error
    # Ansible shows a task's diff from its result's top level: the items' diffs, in order, as one list.
    diffs = [result.pop("diff") for result in results if "diff" in result]
    batch = {"changed": any(result["changed"] for result in results), "results": results}
    return {**batch, "diff": diffs} if diffs else batch


def without_content(arguments: dict) -> dict:
    """The options as the task log shows them: file contents are never logged."""
    shown = {k: v for k, v in arguments.items() if k not in ("content", "content_base64", "batch")}
    if isinstance(arguments.get("batch"), list):
        shown["batch"] = [without_content(item) if isinstance(item, dict) else item for item in arguments["batch"]]
    return shown


# The requests' contents are no no_log options: see the docstring (the module is no_log, the invocation shown
# without them). Per-request checks (path required, mode octal, exactly one content) are options()'s, for the
# task's options and each batch item alike.
ARGUMENT_SPEC = {
    "path": {"type": "str"},
    "state": {"type": "str", "choices": list(STATES), "default": "directory"},
    "owner": {"type": "str", "default": "root"},
    "trusted_owner": {"type": "str", "default": "root"},
    "mode": {"type": "str"},
    "content": {"type": "str", "no_log": False},
    "content_base64": {"type": "str", "no_log": False},
    "recurse": {"type": "bool", "default": False},
    "reclaim": {"type": "bool", "default": False},
    "secret": {"type": "bool", "default": False},
    "host": {"type": "str", "default": "this host"},
    "batch": {"type": "list", "elements": "raw", "no_log": False},
}


class PathModule(AnsibleModule):
    def add_path_info(self, kwargs: dict) -> dict:
        """No file facts from a stat that follows links: the result says only what the walk saw."""
        return kwargs


def main() -> None:
    module = PathModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True, no_log=True)
    # An option not given is absent, as in a batch item (options() fills the defaults).
    arguments = {**{k: v for k, v in module.params.items() if v is not None}, "_ansible_diff": module._diff}
    host = module.params["host"]
    shown = {"invocation": {"module_args": without_content(module.params)}}
    try:
        if arguments.get("batch") is not None:
            result = run_batch(arguments, module.check_mode)
        else:
            result = run(options(arguments), module.check_mode)
    except Refused as error:
        module.fail_json(
            msg=f"{host}: {error}. Root left it as it was. Remove or fix what is named (as root), then rerun.", **shown
        )
    except BatchItemFailed as error:
        module.fail_json(msg=f"{host}: fleet_state_path could not act on {error.path}: {error}", **shown)
    except (ValueError, OSError) as error:
        module.fail_json(msg=f"{host}: fleet_state_path could not act on {arguments.get('path')}: {error}", **shown)
    module.exit_json(**result, **shown)


if __name__ == "__main__":
    main()
