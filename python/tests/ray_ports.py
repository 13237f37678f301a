"""Ray in the sandbox (test_ray_cluster.py, test_ray_single_host.py): the stand-in trainer put in place of verl's in a
script the roles rendered; which TCP ports an account's processes listen on, and whether a connection to one is
accepted, from any host and as any account, over IPv4 or IPv6."""

from __future__ import annotations

import base64
import shlex
from pathlib import PurePosixPath

# A TCP connection to each HOST PORT pair of its arguments in turn (IPv6 where HOST has a colon), each a socket of
# its own, as whoever runs it: a line each, `connected`, or `refused ERRNO` (a firewall's reset, nothing listening, or
# no answer within the time limit). One process for every knock a host makes: a podman exec and a Python start
# each cost more than the knock itself.
CONNECT = (
    "import socket, sys\n"
    "for host, port in zip(sys.argv[1::2], map(int, sys.argv[2::2])):\n"
    "    info = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)[0]\n"
    "    s = socket.socket(info[0], socket.SOCK_STREAM); s.settimeout(5)\n"
    "    try:\n        s.connect(info[4]); print('connected', flush=True)\n"
    "    except OSError as e:\n        print('refused', e.errno, flush=True)\n"
    "    finally:\n        s.close()"
)
# 127.0.0.1 as /proc/net/tcp writes it, and ::1 and ::ffff:127.0.0.1 as /proc/net/tcp6 does (four host-order words).
LOOPBACK = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def connect_all(fleet, host, targets, user="root"):
    """{(address, port): `connected` or `refused`} for each target, knocked on from `host` as `user` in one process."""
    targets = list(targets)
    args = " ".join(f"{shlex.quote(address)} {int(port)}" for address, port in targets)
    done = fleet.exec(host, f"/usr/bin/python3 -I -c {shlex.quote(CONNECT)} {args}", user=user)
    answers = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    assert len(answers) == len(targets), (targets, done.stdout, done.stderr)
    return dict(zip(targets, answers, strict=True))


def connect(fleet, host, address, port, user="root"):
    return connect_all(fleet, host, [(address, port)], user=user)[(address, port)]


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
