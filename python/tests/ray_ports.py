"""Ray in the sandbox (test_ray_cluster.py, test_ray_single_host.py): the stand-in trainer put in place of verl's in a
script the roles rendered; which TCP ports an account's processes listen on, and whether a connection to one is
accepted, from any host and as any account, over IPv4 or IPv6."""

from __future__ import annotations

import base64
import shlex
from pathlib import PurePosixPath

# A TCP connection to HOST:PORT (IPv6 where HOST has a colon) as whoever runs it: `connected`, or `refused ERRNO`
# (a firewall's reset, nothing listening, or no answer within the time limit).
CONNECT = (
    "import socket, sys\n"
    "host, port = sys.argv[1], int(sys.argv[2])\n"
    "info = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]\n"
    "s = socket.socket(info[0], socket.SOCK_STREAM); s.settimeout(5)\n"
    "try:\n    s.connect(info[4]); print('connected')\n"
    "except OSError as e:\n    print('refused', e.errno)"
)
# 127.0.0.1 as /proc/net/tcp writes it, and ::1 and ::ffff:127.0.0.1 as /proc/net/tcp6 does (four host-order words).
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def connect(fleet, host, address, port, user="root"):
    done = fleet.exec(host, f"/usr/bin/python3 -I -c {shlex.quote(CONNECT)} {shlex.quote(address)} {port}", user=user)
    return done.stdout.split()[0] if done.stdout.strip() else done.stderr.strip()


def listening(fleet, host, uid):
    """{(address as /proc/net writes it, port)} of the TCP sockets `uid` listens on (state 0A, the uid column)."""
    found = set()
    for table in ("tcp", "tcp6"):
        for line in fleet.exec(host, f"cat /proc/net/{table}").stdout.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[7] == str(uid):
                address, port = fields[1].split(":")
                found.add((address.upper(), int(port, 16)))
    return found


def ipv6_addresses(fleet, host, interface="eth0"):
    """The host's IPv6 addresses on its fleet interface, a link-local one with its scope (the same interface name on
    the host that knocks)."""
    addresses = []
    for line in fleet.exec(host, "cat /proc/net/if_inet6").stdout.splitlines():
        fields = line.split()
        if len(fields) == 6 and fields[5] == interface:
            text = ":".join(fields[0][i : i + 4] for i in range(0, 32, 4))
            addresses.append(f"{text}%{interface}" if text.startswith("fe80") else text)
    return addresses


def swap_in_trainer(fleet, host, files, script, trainer, copy=None):
    """Write `files` ({path on the host: bytes}, root's, 0644) on `host`, then replace `-m verl.trainer.main_ppo` by
    `trainer` (a path) in `script`, or in `copy`, a copy of it made first: every other line as the role rendered it.
    Returns how many lines were replaced."""
    steps = []
    for path, data in files.items():
        encoded = base64.b64encode(data).decode()
        steps.append(f"install -d -m 0755 {PurePosixPath(path).parent} && echo {encoded} | base64 -d > {path}")
        steps.append(f"chmod 0644 {path}")
    original = f"/root/{PurePosixPath(script).name}.orig"
    edited = copy or script
    steps += [f"cp -p {script} {original}", f"cp -p {script} {edited}"] if copy else [f"cp -p {script} {original}"]
    steps.append(f'sed -i \'s|"$PYTHON" -m verl.trainer.main_ppo |"$PYTHON" {trainer} |\' {edited}')
    done = fleet.exec(host, " && ".join(steps) + f" && diff {original} {edited} | grep -c '^>'")
    assert done.stdout.strip().isdigit(), done.stdout + done.stderr
    return int(done.stdout)
