#!/usr/bin/python3
"""cuda_toolkit's probe of a host, read-only: version.json, `bin/nvcc --version`, the default /usr/local/cuda link,
the role's in-progress marker, free space, apt's view of the host compiler, and who could write the directories root
executes the installer from. Every decision on what it finds is the role's filter (plugins/filter/cuda_toolkit.py).

It was a script root ran through the command module (`python3 -I -S -c`): one module call either way, now in the
collection's one style for root-side code (docs/extending-modules.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat as stat_module
import subprocess

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: cuda_toolkit_probe
short_description: Read a host's CUDA toolkit, default CUDA link, free space, host compiler and private directories.
description:
  - Read-only; every decision on what it returns is the cuda_toolkit role's filter.
  - Runs `nvcc --version` of the toolkit at O(home) when it is executable, and `apt-cache policy` for O(packages).
author: p40fleet
options:
  home:
    description: The toolkit's install path.
    type: str
    required: true
  link_path:
    description: The default CUDA link (C(/usr/local/cuda)).
    type: str
    required: true
  marker:
    description: The role's in-progress marker (JSON); it records the default link as it was before the first try.
    type: str
    required: true
  room:
    description: Pairs of [path, MiB needed]; paths on one file system are summed against its free space.
    type: list
    elements: raw
    default: []
  packages:
    description: Debian packages whose installed and candidate versions are read.
    type: list
    elements: str
    default: []
  private_dirs:
    description: Directories root executes from, checked for anyone but root being able to swap their files.
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Probe the host's CUDA toolkit
  p40fleet.fleet.cuda_toolkit_probe:
    home: "{{ p40fleet_cuda_home }}"
    link_path: /usr/local/cuda
    marker: "{{ cuda_toolkit_marker }}"
    room: [[/var/cache/p40fleet, 4100], [/var/tmp, 8192]]
    packages: [gcc-11, g++-11, libxml2]
    private_dirs: [/var/cache/p40fleet/cuda_toolkit.p40fleet]
  become: true
  register: cuda_toolkit_probe
"""

RETURN = r"""
found:
  description: >-
    What the host holds: arch, home_exists, version_json (or null, with version_json_error), nvcc_release and
    nvcc_version (or null), libcudart, default_link and original_link ({state, target}), marker (or null), room
    (per file system: paths, anchor, need_mib, avail_mib), apt, packages ({installed, candidate} each) and
    private_dir_problems (sentences).
  type: dict
  returned: always
"""

ARGUMENT_SPEC = {
    "home": {"type": "str", "required": True},
    "link_path": {"type": "str", "required": True},
    "marker": {"type": "str", "required": True},
    "room": {"type": "list", "elements": "raw", "default": []},
    "packages": {"type": "list", "elements": "str", "default": []},
    "private_dirs": {"type": "list", "elements": "str", "default": []},
}


def toolkit(home: str) -> dict:
    """version.json's version, nvcc's release and libcudart at `home`."""
    found = {"arch": os.uname().machine, "home_exists": os.path.lexists(home)}
    try:
        with open(os.path.join(home, "version.json")) as handle:
            found["version_json"] = json.load(handle)["cuda"]["version"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        found["version_json"] = None
        found["version_json_error"] = str(error)
    nvcc = os.path.join(home, "bin", "nvcc")
    found["nvcc_release"] = None
    if os.access(nvcc, os.X_OK):
        try:
            answer = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
            release = re.search(r"release (\d+\.\d+), V(\S+)", answer.stdout)
            if answer.returncode == 0 and release:
                found["nvcc_release"] = release.group(1)
                found["nvcc_version"] = release.group(2)
        except (OSError, subprocess.SubprocessError) as error:
            found["nvcc_error"] = str(error)
    found["libcudart"] = os.path.exists(os.path.join(home, "lib64", "libcudart.so"))
    return found


def link_state(path):
    if os.path.islink(path):
        return {"state": "link", "target": os.readlink(path)}
    if os.path.lexists(path):
        return {"state": "other", "target": None}
    return {"state": "absent", "target": None}


def links(link_path: str, marker: str) -> dict:
    """The default link now, the marker, and the link as it was before p40fleet's first attempt (an interrupted run
    recorded it in the marker)."""
    found = {"default_link": link_state(link_path), "marker": None}
    if os.path.lexists(marker):
        try:
            with open(marker) as handle:
                found["marker"] = json.load(handle)
        except (OSError, ValueError):
            found["marker"] = {}
    recorded = found["marker"].get("default_link") if isinstance(found["marker"], dict) else None
    found["original_link"] = recorded if isinstance(recorded, dict) else found["default_link"]
    return found


def existing_ancestor(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def room(needs: list) -> list[dict]:
    """Free space per file system against what the paths on it need together."""
    rooms = {}
    for path, need_mib in needs:
        anchor = existing_ancestor(path)
        stat = os.statvfs(anchor)
        device = os.stat(anchor).st_dev
        entry = rooms.setdefault(
            device,
            {"paths": [], "anchor": anchor, "need_mib": 0, "avail_mib": stat.f_bavail * stat.f_frsize // 1048576},
        )
        entry["paths"].append(path)
        entry["need_mib"] += int(need_mib)
    return list(rooms.values())


def packages(names: list[str]) -> dict:
    """apt's installed and candidate version of each package, when the host has apt."""
    found = {"apt": shutil.which("apt-get") is not None, "packages": {}}
    if found["apt"]:
        for package in names:
            answer = subprocess.run(["apt-cache", "policy", package], capture_output=True, text=True, check=False)
            installed = re.search(r"Installed: (\S+)", answer.stdout)
            candidate = re.search(r"Candidate: (\S+)", answer.stdout)
            found["packages"][package] = {
                "installed": installed.group(1) if installed and installed.group(1) != "(none)" else None,
                "candidate": candidate.group(1) if candidate and candidate.group(1) != "(none)" else None,
            }
    return found


def private_dir_problems(path):
    """Why another account could swap files in `path` (a directory root executes from), or [].

    The directory, when it exists, must be a real directory owned by root. Every existing directory
    above it (after resolving links) must be owned by root and writable by nobody else unless sticky
    (as /var/tmp is); a link on the way must belong to root, or its owner could point it elsewhere."""
    problems = []
    path = os.path.abspath(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    except OSError as error:
        return [f"{path} cannot be inspected ({error.strerror})"]
    if info is not None:
        if not stat_module.S_ISDIR(info.st_mode):
            problems.append(f"{path} exists and is not a directory")
        elif info.st_uid != 0:
            problems.append(f"{path} is owned by uid {info.st_uid}, not root")
    walked = os.path.dirname(path)
    while walked != "/":
        if os.path.islink(walked) and os.lstat(walked).st_uid != 0:
            problems.append(f"{walked} is a link owned by uid {os.lstat(walked).st_uid}, not root")
        walked = os.path.dirname(walked)
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        if os.path.exists(parent):
            info = os.stat(parent)
            if info.st_uid != 0:
                problems.append(f"{parent} is owned by uid {info.st_uid}, not root")
            elif info.st_mode & (stat_module.S_IWGRP | stat_module.S_IWOTH) and not info.st_mode & stat_module.S_ISVTX:
                problems.append(f"{parent} is writable by group or others (mode {oct(info.st_mode & 0o7777)})")
        if parent == "/":
            return problems
        parent = os.path.dirname(parent)


def probe(params: dict) -> dict:
    found = toolkit(params["home"])
    found.update(links(params["link_path"], params["marker"]))
    found["room"] = room(params["room"])
    found.update(packages(params["packages"]))
    found["private_dir_problems"] = [p for path in params["private_dirs"] for p in private_dir_problems(path)]
    return found


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(changed=False, found=probe(module.params))


if __name__ == "__main__":
    main()
