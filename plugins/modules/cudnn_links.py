#!/usr/bin/python3
"""Link cuDNN's headers and libraries into the CUDA tree and remove links to another cuDNN, in one call.

It replaced two loops of ansible.builtin.file (state link with force, state absent): one module run per file, and a
real cuDNN 8.9 archive has about 45 headers and libraries, each one more round trip to every host. The cudnn role
runs it as root, with the lists its own probe (cudnn_probe, root's, read-only) found; the CUDA tree is root's.

- `links`: each {src, dest}; dest becomes a symlink to src unless it already is one. A new link is made beside
  dest and renamed over it, as the file module's force does: a file or a link there is replaced in one step, a
  directory is refused.
- `remove`: links to remove. Only a symlink is removed; anything else there is refused, naming it (the probe lists
  links only: what is there now is not what it saw).
Check mode acts on nothing and reports what would change. It runs once per cuDNN converge, not on every run: an
AnsibleModule with an argument_spec, the collection's one style for root-side modules (docs/extending-modules.md).
"""

from __future__ import annotations

import contextlib
import os
import stat

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: cudnn_links
short_description: Make cuDNN's links into the CUDA tree and remove links to another cuDNN, in one call.
description:
  - Makes the links cuDNN's files need inside the CUDA tree and removes links to another cuDNN, in one call, as root.
  - Refuses to remove anything at a listed path that is not a symlink; supports check mode.
author: p40fleet
options:
  links:
    description: The links to make, each a dict with src (what the link points to) and dest (the link's path).
    type: list
    elements: dict
    default: []
  remove:
    description: Links to remove (absolute paths); anything there that is not a symlink is refused.
    type: list
    elements: str
    default: []
  host:
    description: The host's inventory name, for messages.
    type: str
    default: this host
"""

EXAMPLES = r"""
- name: Link cuDNN into the CUDA tree
  p40fleet.fleet.cudnn_links:
    links:
      - src: /usr/lib/x86_64-linux-gnu/libcudnn.so.8
        dest: "{{ p40fleet_cuda_home }}/lib64/libcudnn.so.8"
    remove: []
    host: "{{ inventory_hostname }}"
"""

RETURN = r"""
linked:
  description: The links made (their paths).
  type: list
  elements: str
  returned: always
removed:
  description: The links removed.
  type: list
  elements: str
  returned: always
"""


ARGUMENT_SPEC = {
    "links": {"type": "list", "elements": "dict", "default": []},
    "remove": {"type": "list", "elements": "str", "default": []},
    "host": {"type": "str", "default": "this host"},
}


class Refused(Exception):
    """A path that is not what the probe saw: the message names it and what is there."""


def absolute(path: object, what: str) -> str:
    if not isinstance(path, str) or not os.path.isabs(path):
        raise ValueError(f"{what} must be an absolute path, got {path!r}")
    return path


def options(arguments: dict) -> dict:
    links = arguments.get("links") or []
    remove = arguments.get("remove") or []
    if not isinstance(links, list) or not all(isinstance(link, dict) for link in links):
        raise ValueError("option links must be a list of {src, dest} dicts")
    if not isinstance(remove, list):
        raise ValueError("option remove must be a list of paths")
    return {
        "links": [
            (absolute(link.get("src"), "a link's src"), absolute(link.get("dest"), "a link's dest")) for link in links
        ],
        "remove": [absolute(path, "a path to remove") for path in remove],
    }


def remove_link(path: str, check_mode: bool) -> bool:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISLNK(info.st_mode):
        raise Refused(f"{path} is no longer a link (found mode {stat.filemode(info.st_mode)}): left as it is")
    if not check_mode:
        os.unlink(path)
    return True


def make_link(src: str, dest: str, check_mode: bool) -> bool:
    try:
        info = os.lstat(dest)
    except FileNotFoundError:
        info = None
    if info is not None:
        if stat.S_ISLNK(info.st_mode) and os.readlink(dest) == src:
            return False
        if stat.S_ISDIR(info.st_mode):
            raise Refused(f"{dest} is a directory, where a link to {src} belongs: left as it is")
    if check_mode:
        return True
    directory, name = os.path.split(dest)
    temp = os.path.join(directory, f".{name}.p40fleet-{os.getpid()}")
    os.symlink(src, temp)
    try:
        os.replace(temp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return True


def run(params: dict, check_mode: bool) -> dict:
    removed = [path for path in params["remove"] if remove_link(path, check_mode)]
    linked = [dest for src, dest in params["links"] if make_link(src, dest, check_mode)]
    return {"changed": bool(removed or linked), "removed": removed, "linked": linked}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    host = module.params["host"]
    try:
        result = run(options(module.params), module.check_mode)
    except Refused as error:
        module.fail_json(msg=f"{host}: {error}. Remove or move it (as root), then rerun the cudnn role.")
    except (ValueError, OSError) as error:
        module.fail_json(msg=f"{host}: cudnn_links could not link cuDNN into the CUDA tree: {error}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
