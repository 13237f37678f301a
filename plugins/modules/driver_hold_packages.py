#!/usr/bin/python3
"""Read-only probe: the installed packages that may be NVIDIA's driver, their versions and dpkg selections
(hold or install), whether unattended-upgrades is installed, the files driver_hold writes and its record of what
it added. Changes nothing; every decision is made by the role's filter plugin (plugins/filter/driver_hold.py)."""

from __future__ import annotations

import json
import os

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: driver_hold_packages
short_description: Read the installed NVIDIA driver candidates, their holds and driver_hold's files.
description:
  - Reads the installed NVIDIA driver candidates, their apt holds and driver_hold's own files.
  - Changes nothing; every decision is made by the role's filter (plugins/filter/driver_hold.py).
author: p40fleet
options:
  preferences_file:
    description: The apt preferences file driver_hold writes (its content is returned).
    type: path
    required: true
  unattended_file:
    description: The unattended-upgrades configuration file driver_hold writes (its content is returned).
    type: path
    required: true
  record_file:
    description: driver_hold's record of what it added (root-owned JSON).
    type: path
    required: true
"""

RETURN = r"""
packages:
  description: Installed packages whose name may be the driver's, each {name, version, selection}.
  type: list
  returned: always
unattended_upgrades:
  description: Whether the unattended-upgrades package is installed.
  type: bool
  returned: always
files:
  description: preferences and unattended -> the file's text, or null where it does not exist.
  type: dict
  returned: always
record:
  description: driver_hold's record (null where there is none or it is unreadable).
  type: dict
  returned: always
"""

EXAMPLES = r"""
- name: Read the driver packages and their holds
  p40fleet.fleet.driver_hold_packages:
    preferences_file: /etc/apt/preferences.d/p40fleet-nvidia-driver
    unattended_file: /etc/apt/apt.conf.d/51p40fleet-nvidia-driver
    record_file: /var/lib/p40fleet/driver_hold.json
  register: driver_hold_found
"""

QUERY = ["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${db:Status-Abbrev}\n"]


def candidate(name: str) -> bool:
    """A cheap first cut; the filter decides which of these are the driver."""
    return "nvidia" in name or name.startswith(("cuda-drivers", "libcuda", "libnv", "libxnvctrl"))


def parse(out: str) -> tuple[list[dict], bool]:
    """dpkg-query lines "name<TAB>version<TAB>abbrev": installed candidates, and whether unattended-upgrades is
    installed. The abbreviation's first letter is the selection (h: hold, i: install), its second the status."""
    packages, seen, unattended = [], set(), False
    for line in out.splitlines():
        parts = line.split("\t")
        if len(parts) != 3 or len(parts[2]) < 2 or parts[2][1] != "i":
            continue
        name, version, abbrev = parts
        if name == "unattended-upgrades":
            unattended = True
        elif candidate(name) and name not in seen:
            seen.add(name)
            packages.append({"name": name, "version": version, "selection": "hold" if abbrev[0] == "h" else "install"})
    return sorted(packages, key=lambda p: p["name"]), unattended


def read(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


ARGUMENT_SPEC = {
    "preferences_file": {"type": "path", "required": True},
    "unattended_file": {"type": "path", "required": True},
    "record_file": {"type": "path", "required": True},
}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    if module.get_bin_path("dpkg-query") is None:
        module.fail_json(msg="dpkg-query not found: driver_hold supports Debian and Ubuntu (apt) hosts only")
    rc, out, err = module.run_command(QUERY)
    if rc != 0:
        module.fail_json(msg=f"dpkg-query failed (rc {rc}): {err.strip()}")
    packages, unattended = parse(out)
    text = read(module.params["record_file"])
    try:
        record = json.loads(text) if text else None
    except ValueError:
        record = None
    module.exit_json(
        changed=False,
        packages=packages,
        unattended_upgrades=unattended,
        files={
            "preferences": read(module.params["preferences_file"]),
            "unattended": read(module.params["unattended_file"]),
        },
        record=record if isinstance(record, dict) else None,
    )


if __name__ == "__main__":
    main()
