#!/usr/bin/python3
"""ray_cluster's probe: the host's IPv4 interfaces, what its inventory address resolves to, and the Ray node settings
p40fleet wrote last (the root-owned env file), read-only. Every decision is the role's filter plugin's."""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: ray_cluster_probe
short_description: Read a host's IPv4 interfaces, what its address resolves to and the Ray node settings p40fleet wrote.
description:
  - Read-only; every decision on what it returns is the ray_cluster role's filter (plugins/filter/ray_cluster.py).
  - An env file that is a symlink or anything but a regular file counts as absent.
author: p40fleet
options:
  address:
    description: The host's inventory address, resolved to IPv4 addresses on the host.
    type: str
    required: true
  env_file:
    description: The root-owned KEY=VALUE file of the Ray node's settings.
    type: path
    required: true
"""

EXAMPLES = r"""
- name: Read the host's interfaces and Ray settings
  p40fleet.fleet.ray_cluster_probe:
    address: "{{ ansible_host | default(inventory_hostname) }}"
    env_file: /etc/p40fleet/ray-node.env
  register: ray_cluster_found
"""

RETURN = r"""
interfaces:
  description: Interface name -> its IPv4 addresses.
  type: dict
  returned: always
addresses:
  description: The IPv4 addresses O(address) resolves to, sorted.
  type: list
  elements: str
  returned: always
env:
  description: The env file's settings (empty where it is absent).
  type: dict
  returned: always
"""

SIOCGIFADDR = 0x8915


def ipv4_of(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return ""
    return socket.inet_ntoa(packed[20:24])


def read_env(path: str) -> dict[str, str]:
    """KEY=VALUE lines of a file root wrote; a symlink or anything but a regular file counts as absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return {}
    with os.fdopen(fd, encoding="utf-8", errors="replace") as handle:
        if not os.path.stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return {}
        env = {}
        for line in handle:
            key, sep, value = line.strip().partition("=")
            if sep and not key.startswith("#"):
                env[key] = value.strip('"')
        return env


ARGUMENT_SPEC = {"address": {"type": "str", "required": True}, "env_file": {"type": "path", "required": True}}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    interfaces = {name: [a for a in [ipv4_of(name)] if a] for _, name in socket.if_nameindex()}
    try:
        resolved = sorted({info[4][0] for info in socket.getaddrinfo(module.params["address"], None, socket.AF_INET)})
    except OSError:
        resolved = []
    module.exit_json(
        changed=False,
        interfaces=interfaces,
        addresses=resolved,
        env=read_env(module.params["env_file"]),
    )


if __name__ == "__main__":
    main()
