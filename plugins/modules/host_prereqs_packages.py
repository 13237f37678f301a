#!/usr/bin/python3
"""Read-only probe: which of the given Debian/Ubuntu packages are missing, and which of those no
configured apt source offers. Runs as the login user; it reads dpkg's database and apt's lists."""

from __future__ import annotations

import re

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: host_prereqs_packages
short_description: Report missing packages and missing apt candidates, changing nothing.
description:
  - Reports the packages that are not installed and those without an apt candidate.
  - Changes nothing; the role installs what it reports.
author: p40fleet
options:
  packages:
    description: Package names to look up.
    type: list
    elements: str
    required: true
"""

RETURN = r"""
missing:
  description: Packages not installed, in the order given.
  type: list
  returned: always
unavailable:
  description: Missing packages without an apt candidate in the current lists.
  type: list
  returned: always
"""

EXAMPLES = r"""
- name: List what is missing
  p40fleet.fleet.host_prereqs_packages:
    packages: [build-essential, git]
  register: host_prereqs_found
"""

# apt-cache must not rebuild its binary caches: that would be a change on the host.
APT_CACHE = ["apt-cache", "-o", "Dir::Cache::pkgcache=", "-o", "Dir::Cache::srcpkgcache=", "policy"]


def installed_packages(module: AnsibleModule, packages: list[str]) -> set[str]:
    # Exits 1 when some package is unknown to dpkg; the known ones are still listed.
    _, out, _ = module.run_command(["dpkg-query", "-W", "-f", "${Package}\t${db:Status-Abbrev}\n", *packages])
    installed = set()
    for line in out.splitlines():
        name, _, status = line.partition("\t")
        if status.startswith("ii"):
            installed.add(name.split(":")[0])
    return installed


def candidates(policy_output: str) -> set[str]:
    """Packages with a candidate version in `apt-cache policy` output."""
    offered = set()
    for match in re.finditer(r"^(\S+):\n(?:[ \t]+.*\n)*?[ \t]+Candidate: (\S+)", policy_output, re.MULTILINE):
        if match.group(2) != "(none)":
            offered.add(match.group(1).split(":")[0])
    return offered


ARGUMENT_SPEC = {"packages": {"type": "list", "elements": "str", "required": True}}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    packages = module.params["packages"]
    for tool in ("dpkg-query", "apt-cache"):
        if module.get_bin_path(tool) is None:
            module.fail_json(msg=f"{tool} not found: host_prereqs supports Debian and Ubuntu (apt) hosts only")
    installed = installed_packages(module, packages)
    missing = [p for p in packages if p not in installed]
    unavailable: list[str] = []
    if missing:
        rc, out, err = module.run_command([*APT_CACHE, *missing])
        if rc != 0:
            module.fail_json(msg=f"apt-cache policy failed (rc {rc}): {err.strip()}")
        offered = candidates(out)
        unavailable = [p for p in missing if p not in offered]
    module.exit_json(changed=False, missing=missing, unavailable=unavailable)


if __name__ == "__main__":
    main()
