#!/usr/bin/python3
"""cudnn's probe of a host's cuDNN state, read-only: the prefix's cudnn_version.h and symlinks, the links in the CUDA
tree, the role's record of what it installed, and the dynamic linker configuration. Every decision on what it finds
is the cudnn role's.

It was a script root ran through the command module (`python3 -I -S -c`): one module call either way, now in the
collection's one style for root-side code (docs/extending-modules.md).
"""

from __future__ import annotations

import glob
import json
import os
import re

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: cudnn_probe
short_description: Read a host's cuDNN prefix, its links into the CUDA tree and the linker configuration.
description:
  - Read-only; every decision on what it returns is the cudnn role's.
  - Reads the prefix's include/cudnn_version.h and lib/libcudnn.so.N symlinks, the links cuDNN's files need in the
    CUDA tree, the role's record of the prefix it installed, and /etc/ld.so.conf with /etc/ld.so.conf.d/*.conf.
author: p40fleet
options:
  prefix:
    description: Where cuDNN's tree is (or is unpacked for a check), without a trailing slash.
    type: str
    required: true
  cuda_home:
    description: The CUDA toolkit's tree that cuDNN's headers and libraries are linked into.
    type: str
    required: true
  link_into_cuda:
    description: Whether the links into the CUDA tree are wanted (and so read).
    type: bool
    required: true
  state_file:
    description: The role's record of what it installed (JSON); absent or unreadable counts as none.
    type: str
    required: true
"""

EXAMPLES = r"""
- name: Probe the host's cuDNN
  p40fleet.fleet.cudnn_probe:
    prefix: "{{ cudnn_prefix }}"
    cuda_home: "{{ p40fleet_cuda_home }}"
    link_into_cuda: true
    state_file: /var/lib/p40fleet/cudnn.json
  register: cudnn_probe
"""

RETURN = r"""
found:
  description: >-
    What the host holds: prefix_exists, cuda_home_exists, prefix_version (X.Y.Z or null), prefix_symlinks_ok,
    links_missing (each {src, dest}), links_stale, foreign_files, recorded (the record or null), old_prefix (an
    earlier prefix still on disk, or null) and registered (the linker's entries for the prefix and the CUDA tree).
  type: dict
  returned: always
"""

ARGUMENT_SPEC = {
    "prefix": {"type": "str", "required": True},
    "cuda_home": {"type": "str", "required": True},
    "link_into_cuda": {"type": "bool", "required": True},
    "state_file": {"type": "str", "required": True},
}

# prefix sub-directory -> CUDA tree sub-directory (the archive has lib/, CUDA has lib64/)
PAIRS = {"lib": "lib64", "include": "include"}
NAME_PATTERN = re.compile(r"^(lib)?cudnn")


def header_version(path: str) -> str | None:
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError:
        return None
    parts = [re.search(rf"#define\s+CUDNN_{key}\s+(\d+)", text) for key in ("MAJOR", "MINOR", "PATCHLEVEL")]
    return ".".join(p.group(1) for p in parts) if all(parts) else None


def links(prefix: str, cuda_home: str, wanted: bool) -> dict:
    """The links the CUDA tree needs to the prefix's files, those it lacks, and other cuDNN names there."""
    desired = {}
    for sub, cuda_sub in PAIRS.items():
        directory = os.path.join(prefix, sub)
        if os.path.isdir(directory):
            for name in sorted(os.listdir(directory)):
                desired[os.path.join(cuda_home, cuda_sub, name)] = os.path.join(directory, name)
    missing, stale, foreign = [], [], []
    if wanted and os.path.isdir(cuda_home):
        for dest, src in desired.items():
            if not (os.path.islink(dest) and os.readlink(dest) == src):
                missing.append({"src": src, "dest": dest})
        for cuda_sub in PAIRS.values():
            directory = os.path.join(cuda_home, cuda_sub)
            if not os.path.isdir(directory):
                continue
            for name in sorted(os.listdir(directory)):
                path = os.path.join(directory, name)
                if not NAME_PATTERN.match(name) or path in desired:
                    continue
                (stale if os.path.islink(path) else foreign).append(path)
    return {"links_missing": missing, "links_stale": stale, "foreign_files": foreign}


def probe(prefix: str, cuda_home: str, link_into_cuda: bool, state_file: str) -> dict:
    prefix, cuda_home = prefix.rstrip("/") or "/", cuda_home.rstrip("/") or "/"
    found = {"prefix_exists": os.path.isdir(prefix), "cuda_home_exists": os.path.isdir(cuda_home)}
    found["prefix_version"] = header_version(os.path.join(prefix, "include", "cudnn_version.h"))
    # The archive ships libcudnn.so.N as a symlink; a copy without -P turns it into a file (ldconfig complains).
    sonames = glob.glob(os.path.join(prefix, "lib", "libcudnn.so.[0-9]"))
    found["prefix_symlinks_ok"] = bool(sonames) and all(os.path.islink(p) and os.path.exists(p) for p in sonames)
    found.update(links(prefix, cuda_home, link_into_cuda))
    found["recorded"] = None
    try:
        with open(state_file) as handle:
            found["recorded"] = json.load(handle)
    except (OSError, ValueError):
        pass
    old = (found["recorded"] or {}).get("prefix") if isinstance(found["recorded"], dict) else None
    found["old_prefix"] = old if old and old != prefix and os.path.isdir(old) else None
    registered = []
    for conf in ["/etc/ld.so.conf", *sorted(glob.glob("/etc/ld.so.conf.d/*.conf"))]:
        try:
            with open(conf) as handle:
                lines = {line.strip().rstrip("/") for line in handle}
        except OSError:
            continue
        registered += [d for d in (os.path.join(prefix, "lib"), os.path.join(cuda_home, "lib64")) if d in lines]
    found["registered"] = sorted(set(registered))
    return found


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    module.exit_json(changed=False, found=probe(**module.params))


if __name__ == "__main__":
    main()
