#!/usr/bin/python3
"""apex's check of a built wheel, read-only: which expected extension modules it lacks (read as a zip) and whether the
build ran serially (its log). It reads root's copies of the wheel and the log, never through a link and never
blocking on a FIFO: the build account wrote the originals.

It was a script root ran through the command module (`python3 -I -c`): one module call either way, now in the
collection's one style for root-side code (docs/extending-modules.md).
"""

from __future__ import annotations

import os
import stat
import zipfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: apex_wheel_check
short_description: List the extension modules a built Apex wheel holds and whether its build ran serially.
description:
  - Read-only. Opens O(wheel) and O(build_log) without following a link and without blocking; anything but a regular
    file there is refused, naming it.
author: p40fleet
options:
  wheel:
    description: Root's copy of the built wheel.
    type: str
    required: true
  build_log:
    description: Root's copy of the build's log; "we could not find ninja" in it means the build ran serially.
    type: str
    required: true
  host:
    description: The host's inventory name, for messages.
    type: str
    default: this host
  modules:
    description: The top-level extension modules the pinned setup.py builds.
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: List the extension modules in the built wheel
  p40fleet.fleet.apex_wheel_check:
    wheel: /var/lib/p40fleet/apex-build/apex-0.1-cp311-cp311-linux_x86_64.whl
    build_log: /var/lib/p40fleet/apex-build/build.log
    modules: [amp_C, apex_C, fused_layer_norm_cuda]
    host: "{{ inventory_hostname }}"
  become: true
  register: apex_wheel_check
"""

RETURN = r"""
missing:
  description: The expected modules the wheel lacks.
  type: list
  elements: str
  returned: success
built:
  description: The top-level extension modules the wheel holds, sorted.
  type: list
  elements: str
  returned: success
serial:
  description: Whether the build log says torch found no ninja (the build ran serially).
  type: bool
  returned: success
"""

ARGUMENT_SPEC = {
    "wheel": {"type": "str", "required": True},
    "build_log": {"type": "str", "required": True},
    "modules": {"type": "list", "elements": "str", "default": []},
    "host": {"type": "str", "default": "this host"},
}


class Refused(Exception):
    """Not a regular file where root's copy belongs."""


def open_regular(path: str, mode: str = "rb", **kwargs):
    """Root's copies of the build's wheel and log: still never through a link, never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Refused(f"{path} is not a regular file: refused")
    return os.fdopen(fd, mode, **kwargs)


def check(wheel: str, build_log: str, modules: list[str]) -> dict:
    with open_regular(wheel) as handle, zipfile.ZipFile(handle) as archive:
        # Top-level extension modules: NAME.cpython-310-x86_64-linux-gnu.so (or NAME.so / NAME.abi3.so).
        built = {name.split(".", 1)[0] for name in archive.namelist() if "/" not in name and name.endswith(".so")}
    with open_regular(build_log, "r", errors="replace") as handle:
        serial = "we could not find ninja" in handle.read()
    return {"missing": [m for m in modules if m not in built], "built": sorted(built), "serial": serial}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = module.params
    try:
        result = check(params["wheel"], params["build_log"], params["modules"])
    except (Refused, OSError, zipfile.BadZipFile) as error:
        module.fail_json(msg=f"{params['host']}: the Apex wheel check could not read the build: {error}")
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
