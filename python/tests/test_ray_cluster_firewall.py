"""ray_cluster's firewall (plugins/filter/ray_cluster.py's ray_cluster_firewall), for real: the rendered ruleset is
checked by nft and then loaded into a network namespace of its own on this machine (unshare -n: the test machine's
own rules are never touched), where Ray's port is served and connections are tried as the attacks on the cluster make
them: from another local account (a job submitted to the dashboard on 127.0.0.1, the GCS on the fleet address) and
from an address that is no member (a node that is no member registering). The sandbox hosts (podman) run the same
ruleset in test_ray_cluster.py; here each verdict is the kernel's.

Needs nft (nftables, `make test-deps`) and root for the namespaces: without them the tests say so and skip."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

RULES = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_fw")
NFT = shutil.which("nft") or ("/usr/sbin/nft" if os.path.exists("/usr/sbin/nft") else None)
OWNER_UID = 4242
OTHER_UID = 4243
# The accounts' client: the system Python (the checkout's venv may lie where those accounts cannot read).
CLIENT = "/usr/bin/python3"
PORTS = [6379, 8265, 10001, [6380, 6384], [10002, 10999], 52365]
# The ports the role configures by default (defaults/main.yml), as vars/main.yml lists them.
PORTS_BY_DEFAULT = [6379, 8265, 10001, 6380, 6381, 6382, 6383, 6384, 6386, 6387, 52365, 6385, [10002, 10999]]
# The launch script's own Ray (roles/launch_script/defaults/main.yml), which the cluster's table holds too.
LAUNCH_PORTS_BY_DEFAULT = [6390, 6391, 6392, 6393, 6394, 6395, 6396, 6397, 52366, 11000, [11001, 11999]]


def test_ruleset_admits_members_and_loopback_only():
    text = RULES.ray_cluster_firewall(["10.0.0.3", "10.0.0.1", "10.0.0.2"], PORTS, OWNER_UID)
    lines = [line.strip() for line in text.splitlines()]
    # Loaded as one transaction that replaces only p40fleet's own table.
    assert lines[1:4] == ["table inet p40fleet_ray", "delete table inet p40fleet_ray", "table inet p40fleet_ray {"]
    assert "elements = { 6379-6384, 8265, 10001-10999, 52365 }" in lines
    assert "elements = { 10.0.0.1, 10.0.0.2, 10.0.0.3 }" in lines
    assert "ct state new tcp dport @ports meta skuid { 0, 4242 } accept" in lines
    assert lines.index("ct state new tcp dport @ports ip saddr @members accept") < lines.index(
        "ct state new tcp dport @ports reject with tcp reset"
    )


def test_a_host_in_no_cluster_admits_only_root_and_the_owner_on_loopback():
    """The launch script's own Ray on a host in no cluster: no member set, no rule that admits an address."""
    text = RULES.ray_cluster_firewall([], [6390, [11001, 11999]], OWNER_UID)
    lines = [line.strip() for line in text.splitlines()]
    assert "set members {" not in lines and not any("@members" in line for line in lines)
    assert [line for line in lines if line.endswith("accept") and "dport" in line] == [
        'ct state new tcp dport @ports iif "lo" accept',
        "ct state new tcp dport @ports meta skuid { 0, 4242 } accept",
    ]
    assert "ct state new tcp dport @ports reject with tcp reset" in lines


@pytest.mark.parametrize(
    ("members", "ports", "uid", "wrong"),
    [
        (["10.0.0.1; flush ruleset"], PORTS, OWNER_UID, "IPv4"),
        (["10.0.0.1"], [0], OWNER_UID, "not a TCP port"),
        (["10.0.0.1"], [[10999, 10002]], OWNER_UID, "not a TCP port"),
        (["10.0.0.1"], PORTS, 0, "never root"),
        (["10.0.0.1"], PORTS, "4242 } accept; meta skuid {", "invalid literal"),
    ],
)
def test_ruleset_refuses_what_is_not_an_address_port_or_uid(members, ports, uid, wrong):
    with pytest.raises(ValueError, match=wrong):
        RULES.ray_cluster_firewall(members, ports, uid)


def need_nft():
    if NFT is None:
        pytest.skip("nft is not installed: run `make test-deps` (package nftables)")


def test_nft_accepts_the_ruleset_and_refuses_a_broken_one(tmp_path):
    need_nft()
    good = tmp_path / "good.nft"
    good.write_text(RULES.ray_cluster_firewall(["10.0.0.1", "10.0.0.2"], PORTS, OWNER_UID))
    done = subprocess.run([NFT, "-c", "-f", str(good)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    # The same check fails where the text is not nft's: the check above can fail.
    bad = tmp_path / "bad.nft"
    bad.write_text(good.read_text().replace("reject with tcp reset", "reject with tcp bogus", 1))
    assert subprocess.run([NFT, "-c", "-f", str(bad)], capture_output=True, check=False).returncode != 0


# Run inside `unshare -n` as root: a head namespace (this one) joined by a veth pair to a peer namespace holding a
# member's address and a stranger's; the head serves Ray's GCS port and loads the ruleset; every connection tried
# is reported as connected or refused.
HARNESS = textwrap.dedent(
    """
    import json, os, socket, subprocess, sys, time
    nft, ruleset, owner, other, client = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]

    def sh(*argv):
        subprocess.run(argv, check=True, capture_output=True)

    peer = subprocess.Popen(["unshare", "-n", "sleep", "60"])
    time.sleep(0.3)
    try:
        sh("ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", "head0", "type", "veth", "peer", "name", "peer0")
        sh("ip", "link", "set", "peer0", "netns", str(peer.pid))
        sh("ip", "addr", "add", "10.77.0.1/24", "dev", "head0")
        sh("ip", "link", "set", "head0", "up")
        into_peer = ["nsenter", "-t", str(peer.pid), "-n"]
        sh(*into_peer, "ip", "link", "set", "lo", "up")
        sh(*into_peer, "ip", "addr", "add", "10.77.0.2/24", "dev", "peer0")
        sh(*into_peer, "ip", "addr", "add", "10.77.0.3/24", "dev", "peer0")
        sh(*into_peer, "ip", "link", "set", "peer0", "up")
        sh(nft, "-f", ruleset)
        server = socket.socket()
        server.bind(("0.0.0.0", 6379))
        server.listen(16)
        server.settimeout(0.1)

        def attempt(address, uid=None, source=None, peer_side=False):
            code = (
                "import socket, sys\\n"
                "s = socket.socket(); s.settimeout(3)\\n"
                f"if {source!r}: s.bind(({source!r}, 0))\\n"
                f"try:\\n    s.connect(({address!r}, 6379)); print('connected')\\n"
                "except OSError as e:\\n    print('refused', e.errno)\\n"
            )
            argv = (into_peer if peer_side else []) + [client, "-I", "-c", code]
            done = subprocess.run(argv, capture_output=True, text=True, user=uid, check=False, timeout=30)
            try:
                server.accept()[0].close()
            except OSError:
                pass
            return (done.stdout.strip() or done.stderr.strip()).split()[0]

        print(json.dumps({
            "owner on loopback": attempt("127.0.0.1", owner),
            "root on loopback": attempt("127.0.0.1"),
            "another account on loopback": attempt("127.0.0.1", other),
            "another account to the fleet address": attempt("10.77.0.1", other),
            "a member": attempt("10.77.0.1", source="10.77.0.2", peer_side=True),
            "an address that is no member": attempt("10.77.0.1", source="10.77.0.3", peer_side=True),
        }))
    finally:
        peer.kill()
    """
)


@pytest.mark.parametrize(
    ("members", "member_reaches"),
    [(["10.77.0.1", "10.77.0.2"], "connected"), ([], "refused")],
    ids=["cluster", "no-cluster"],
)
def test_only_members_and_the_owner_reach_rays_port(tmp_path, members, member_reaches):
    need_nft()
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"):
        pytest.skip("needs root, unshare and nsenter for network namespaces of its own")
    if not os.access(CLIENT, os.X_OK):
        pytest.skip(f"{CLIENT} is missing: the other accounts' connections are tried with the system Python")
    ruleset = tmp_path / "ray.nft"
    ruleset.write_text(RULES.ray_cluster_firewall(members, [6379], OWNER_UID))
    ruleset.chmod(0o644)
    os.chmod(tmp_path, 0o755)
    done = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            "-I",
            "-c",
            HARNESS,
            NFT,
            str(ruleset),
            str(OWNER_UID),
            str(OTHER_UID),
            CLIENT,
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {
        "owner on loopback": "connected",
        "root on loopback": "connected",
        "another account on loopback": "refused",
        "another account to the fleet address": "refused",
        "a member": member_reaches,
        "an address that is no member": "refused",
    }


PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "ray_firewall.yml"
PLAYBOOK_BIN = Path(sys.executable).with_name("ansible-playbook")


def member_inventory(tmp_path):
    need_nft()
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for a network namespace of its own")
    plan = {"cluster": "demo", "head": "head", "members": ["head", "w1"], "nnodes": 2, "gpus_per_node": 1}
    head = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_cluster": "demo",
        "ray_cluster_plan": plan,
        "ray_cluster_iface": {"name": "eth0", "address": "10.0.0.1", "error": ""},
        "ray_cluster_owner_uid": str(OWNER_UID),
        "ray_cluster_config_dir": str(tmp_path),
    }
    w1 = {"ray_cluster_iface": {"name": "eth0", "address": "10.0.0.2", "error": ""}}
    tmp_path.chmod(0o755)  # the role's directory of its settings, as it makes it
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"head": head, "w1": w1}}}))
    return f"{PLAYBOOK_BIN} -i {inventory} -l head {PLAYBOOK}"


def in_namespace(tmp_path, script):
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO_ROOT / "ansible.cfg"), ANSIBLE_CACHE_PLUGIN_CONNECTION=str(tmp_path))
    return subprocess.run(
        ["unshare", "-n", "sh", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_role_loads_its_table_once_and_a_rerun_changes_nothing(tmp_path):
    """tasks/firewall.yml run twice in a network namespace of its own: the rendered file, the table loaded (and nft's
    listing of it kept), then no change; the members' addresses come from each member's fleet interface (hostvars)."""
    run = member_inventory(tmp_path)
    script = f"{run} > first.log 2>&1; echo $? > first.rc; {run} > second.log 2>&1; echo $? > second.rc; " + (
        f"{NFT} list table inet p40fleet_ray > listed.txt 2>&1"
    )
    done = in_namespace(tmp_path, script)
    assert done.returncode == 0, done.stderr
    first, second = (tmp_path / "first.log").read_text(), (tmp_path / "second.log").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "0", first[-3000:]
    assert re.search(r"head\s*:\s*ok=\d+\s+changed=3\b", first), first[-1500:]
    assert (tmp_path / "second.rc").read_text().strip() == "0", second[-3000:]
    assert re.search(r"head\s*:\s*ok=\d+\s+changed=0\b", second), second[-1500:]
    rendered = (tmp_path / "firewall.nft").read_text()
    ports = PORTS_BY_DEFAULT + LAUNCH_PORTS_BY_DEFAULT
    assert rendered == RULES.ray_cluster_firewall(["10.0.0.1", "10.0.0.2"], ports, OWNER_UID)
    listed = (tmp_path / "listed.txt").read_text()
    assert "10.0.0.1, 10.0.0.2" in listed and "meta skuid { 0, 4242 } accept" in listed, listed
    assert (tmp_path / "firewall.listed").read_text() == listed


# Changed live after root loaded it, its file untouched: a rule that admits every address to Ray's GCS, inserted
# first; or the whole table gone. Before, a re-run saw the table present and the file unchanged and left it so, and
# nothing read the live table before a job.
TAMPERED = {
    "a rule added": f"{NFT} insert rule inet p40fleet_ray input tcp dport 6379 accept",
    "the table deleted": f"{NFT} delete table inet p40fleet_ray",
}


@pytest.mark.parametrize("tamper", sorted(TAMPERED))
def test_a_live_table_changed_after_loading_is_refused_then_loaded_again(tmp_path, tamper):
    run = member_inventory(tmp_path)
    check = f"{run} -e firewall_entry=firewall_live.yml"
    script = (
        f"{run} > load.log 2>&1 && {TAMPERED[tamper]} && {check} > check.log 2>&1 && cp verdict.json tampered.json && "
        f"{run} > reload.log 2>&1 && {check} >> check.log 2>&1 && {NFT} list table inet p40fleet_ray > listed.txt"
    )
    done = in_namespace(tmp_path, script)
    logs = "".join(
        (tmp_path / f).read_text() for f in ("load.log", "check.log", "reload.log") if (tmp_path / f).exists()
    )
    assert done.returncode == 0, done.stderr + logs[-3000:]
    # What `train start` (a cluster's members) and `cluster status` read: the live table, not the file.
    tampered = json.loads((tmp_path / "tampered.json").read_text())
    assert tampered["ok"] is False, tampered
    wanted = "differs from the one root loaded" if tamper == "a rule added" else "is missing"
    assert f"head: the live nftables table inet p40fleet_ray {wanted}" in tampered["message"]
    # What a host alone's `train start` runs before its Ray: the table loaded again, as its file says (its listing is
    # the one kept: only the load changed something).
    assert re.search(r"head\s*:\s*ok=\d+\s+changed=1\b", (tmp_path / "reload.log").read_text())
    assert json.loads((tmp_path / "verdict.json").read_text()) == {"ok": True, "message": ""}
    listed = (tmp_path / "listed.txt").read_text()
    assert "tcp dport 6379 accept" not in listed and listed == (tmp_path / "firewall.listed").read_text()
