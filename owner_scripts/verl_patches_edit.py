#!/usr/bin/python3
"""Make every edit of a patch set in one call, as the verl checkout's owner (fleet_state_owner_run runs it).

It replaced a lineinfile task and a replace task looped over the entries, and a copy task looped over the files
to restore: about 15 module runs per apply, each a round trip, now one. The edits are the ones those modules made,
byte for byte:

- `lineinfile` entries (one line each): the last line the anchor matches (re.search on the line as bytes, its
  newline included) becomes the anchor's match expanded with `replace`, ending with a newline;
- `replace` entries: re.subn over the file as UTF-8 text with re.MULTILINE, every occurrence.

Entries apply in the order given: the role passes the lineinfile entries first, then the replace entries, the
order the two loops ran in. A file named in `restore` starts from its pristine copy under `state_dir`/pristine
(an earlier run edited it, or a profile swap); every other file from what the checkout holds. All files are
computed first and every anchor's count is checked on what it edits: a mismatch fails the task before any file
is written. A file is written only when its content changes: a new file beside it (O_EXCL), the old one's mode,
renamed over it. Check mode writes nothing; with --diff the result carries each file's before and after.

It runs as the owner and touches only the owner's checkout: nothing here crosses the privilege boundary. It is no
Ansible module (a module run as the owner could forge its result: docs/privileges.md): the role starts it with
`python3 -I -S -c` through fleet_state_owner_run, its options as JSON on stdin, and reads its JSON stdout only to
report what changed.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import sys

DOCUMENTATION = r"""
module: verl_patches_edit
short_description: Apply a verl patch set's edits (lineinfile and replace entries) to a checkout in one call.
options:
  source_dir:
    description: The verl checkout (absolute path); entries name files relative to it.
    type: path
    required: true
  state_dir:
    description: The role's state directory; files in restore start from its pristine/ copies.
    type: path
    required: true
  restore:
    description: Files (relative) that start from their pristine copy instead of the checkout's content.
    type: list
    default: []
  entries:
    description: >-
      The patch set's active entries, each with id, file, module (lineinfile or replace), anchor, count and
      replace.
    type: list
    required: true
  host:
    description: The host's inventory name, for messages.
    type: str
    default: this host
"""

LINESEP = os.linesep.encode()


class Refused(Exception):
    """An entry that does not fit the content it would edit: nothing is written."""


def plain(rel: str) -> str:
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or rel.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise Refused(f"{rel!r} is not a plain path relative to the checkout")
    return rel


def read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def edit_line(data: bytes, entry: dict) -> bytes:
    """ansible.builtin.lineinfile with regexp, line, backrefs: true."""
    lines = io.BytesIO(data).readlines()
    pattern = re.compile(entry["anchor"].encode())
    found = [(number, match) for number, line in enumerate(lines) if (match := pattern.search(line))]
    if len(found) != entry["count"]:
        raise Refused(
            f"{entry['id']} ({entry['file']}): anchor /{entry['anchor']}/ matches {len(found)} line(s),"
            f" expected {entry['count']}"
        )
    number, match = found[-1]
    new = match.expand(entry["replace"].encode())
    lines[number] = new if new.endswith(LINESEP) else new + LINESEP
    return b"".join(lines)


def edit_all(data: bytes, entry: dict) -> bytes:
    """ansible.builtin.replace with regexp, replace (re.MULTILINE, every occurrence)."""
    text, done = re.subn(re.compile(entry["anchor"], re.MULTILINE), entry["replace"], data.decode("utf-8"))
    if done != entry["count"]:
        raise Refused(
            f"{entry['id']} ({entry['file']}): anchor /{entry['anchor']}/ found {done}x, expected {entry['count']}x"
        )
    return text.encode("utf-8")


EDITS = {"lineinfile": edit_line, "replace": edit_all}


def plan(params: dict) -> dict[str, tuple[bytes | None, bytes]]:
    """{file: (content now, content wanted)} for every file restored or edited, in first-named order."""
    files: dict[str, tuple[bytes | None, bytes]] = {}

    def start(rel: str) -> None:
        if rel in files:
            return
        now = read(os.path.join(params["source_dir"], rel))
        base = read(os.path.join(params["state_dir"], "pristine", rel)) if rel in params["restore"] else now
        if base is None:
            where = "its pristine copy" if rel in params["restore"] else "the file"
            raise Refused(f"{rel}: {where} is missing")
        files[rel] = (now, base)

    for rel in params["restore"]:
        start(plain(rel))
    for entry in params["entries"]:
        if entry.get("module") not in EDITS:
            raise Refused(f"{entry.get('id')}: module {entry.get('module')!r} is not one of {', '.join(EDITS)}")
        rel = plain(entry["file"])
        start(rel)
        now, data = files[rel]
        files[rel] = (now, EDITS[entry["module"]](data, entry))
    return files


def write(path: str, data: bytes) -> None:
    """The new content beside the file, with its mode, renamed over it."""
    directory, name = os.path.split(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o644
    temp = os.path.join(directory, f".{name}.p40fleet-{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            os.fchmod(handle.fileno(), mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def run(params: dict, check_mode: bool, want_diff: bool) -> dict:
    files = plan(params)
    changed = [rel for rel, (now, wanted) in files.items() if now != wanted]
    if not check_mode:
        for rel in changed:
            write(os.path.join(params["source_dir"], rel), files[rel][1])
    result = {"changed": bool(changed), "files": changed, "entries": [entry["id"] for entry in params["entries"]]}
    if want_diff:
        result["diff"] = [
            {
                "before_header": f"{params['source_dir']}/{rel}",
                "after_header": f"{params['source_dir']}/{rel}",
                "before": (files[rel][0] or b"").decode("utf-8", "replace"),
                "after": files[rel][1].decode("utf-8", "replace"),
            }
            for rel in changed
        ]
    return result


def options(arguments: dict) -> dict:
    params = {
        "source_dir": arguments.get("source_dir"),
        "state_dir": arguments.get("state_dir"),
        "restore": arguments.get("restore") or [],
        "entries": arguments.get("entries"),
    }
    for key in ("source_dir", "state_dir"):
        if not isinstance(params[key], str) or not os.path.isabs(params[key]):
            raise ValueError(f"option {key} must be an absolute path, got {params[key]!r}")
    if not isinstance(params["entries"], list) or not all(isinstance(entry, dict) for entry in params["entries"]):
        raise ValueError("option entries must be a list of patch set entries")
    if not isinstance(params["restore"], list):
        raise ValueError("option restore must be a list of files")
    return params


def main() -> None:
    arguments = json.load(sys.stdin)
    host = str(arguments.get("host", "this host"))
    try:
        result = run(
            options(arguments), bool(arguments.get("_ansible_check_mode")), bool(arguments.get("_ansible_diff"))
        )
    except Refused as error:
        result = {"failed": True, "msg": f"{host}: {error}. No file was written."}
    except (ValueError, KeyError, OSError, UnicodeDecodeError, re.error) as error:
        result = {
            "failed": True,
            "msg": f"{host}: verl_patches_edit could not edit {arguments.get('source_dir')}: {error}",
        }
    result["invocation"] = {"module_args": {k: v for k, v in arguments.items() if not k.startswith("_ansible_")}}
    print(json.dumps(result))
    sys.exit(1 if result.get("failed") else 0)


if __name__ == "__main__":
    main()
