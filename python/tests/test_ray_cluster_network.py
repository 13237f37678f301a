"""ray_cluster's network measurement (entry point `network`, tasks/network.yml) run by Ansible on two members at once,
on this machine: each "host" is a local connection with a root-owned ray.env of its own, as playbooks/cluster.yml
writes it; the CPU venv (the hosts' torch) stands in for the env, so the all-reduce is the role's script over
loopback with gloo, started by fleet_state_owner_run. Root plays the env owner (local_hosts.ROOT_PLAYS_OWNER): the
CPU venv's interpreter lies where no other account can run it (the switch to the owner is
test_fleet_state_owner_run.py's). No containers."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest
import yaml

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT
from tests.local_hosts import ROOT_PLAYS_OWNER
from tests.source_modules import load_module

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: fleet_state_owner_run starts the owner's process"
)

FIREWALL = load_module(REPO_ROOT / "plugins" / "filter" / "ray_cluster.py", "ray_cluster_firewall_for_network")
ROOT = ROOT_PLAYS_OWNER
PLAYBOOK = """
- name: Measure the network between the cluster's members
  hosts: all
  gather_facts: false
  tasks:
    - name: Measure
      ansible.builtin.include_role:
        name: ray_cluster
        tasks_from: network
    - name: Keep what each member published
      ansible.builtin.copy:
        content: "{{ ray_cluster_network | to_json }}"
        dest: "{{ playbook_dir }}/{{ inventory_hostname }}.json"
"""


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fleet(tmp_path, envs, port):
    """Two members of cluster `pair`, each with its ray.env (envs: {host: overrides of its settings, None: no file})
    and the firewall file the role renders for them (plugins/filter/ray_cluster.py), its ports Ray's default ones
    and `port` where the all-reduce meets (None: not among them)."""
    python = cpu_venv.python()
    ports = [6379, 8265, [10001, 10999]] + ([port] if port else [])
    firewall = FIREWALL.ray_cluster_firewall(["127.0.0.1"], ports, 4242)
    hosts = {}
    for host, changed in envs.items():
        config = tmp_path / host
        config.mkdir()
        settings = {
            "P40FLEET_RAY_CLUSTER": "pair",
            "P40FLEET_RAY_ROLE": "head" if host == "m0" else "worker",
            "P40FLEET_RAY_HEAD_ADDRESS": "127.0.0.1:6379",
            "P40FLEET_RAY_NUM_GPUS": "0",
            "NCCL_SOCKET_IFNAME": "lo",
            **(changed or {}),
        }
        if changed is not None:
            (config / "ray.env").write_text("".join(f"{k}={v}\n" for k, v in settings.items()))
            (config / "firewall.nft").write_text(firewall)
        hosts[host] = {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
            "p40fleet_cluster": "pair",
            "ray_cluster_config_dir": str(config),
            "ray_cluster_owner": "root",
            # The CPU venv's python stands in for the env's: the role runs the python beside its ray.
            "ray_cluster_ray_bin": str(python.parent / "ray"),
        }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    playbook = tmp_path / "network.yml"
    playbook.write_text(PLAYBOOK)
    return playbook, inventory


SMALL = {
    "ray_cluster_network_bytes": 4 * 2**20,
    "ray_cluster_network_iterations": 3,
    "ray_cluster_network_timeout": 60,
    # Loopback on a shared test machine is no fleet link: thresholds it always meets keep the verdict known.
    "ray_cluster_network_min_busbw": 0.001,
    "ray_cluster_network_step_seconds": 10**6,
}


def test_both_members_measure_at_once_and_publish_the_heads_result(tmp_path, run_playbook):
    port = free_port()
    playbook, inventory = fleet(tmp_path, {"m0": {}, "m1": {}}, port)
    result = run_playbook(playbook, inventory, extra_vars={**SMALL, "ray_cluster_network_port": port}, envvars=ROOT)
    assert not result.failures, result.stdout[-3000:]
    published = {h: json.loads((tmp_path / f"{h}.json").read_text()) for h in ("m0", "m1")}
    assert published["m0"] == published["m1"]
    measured = published["m0"]
    assert (measured["cluster"], measured["members"], measured["world"]) == ("pair", ["m0", "m1"], 2)
    assert (measured["backend"], measured["bytes"], measured["iterations"]) == ("gloo", 4 * 2**20, 3)
    assert measured["busbw_gbps"] > 0 and measured["verdict"] == "pass"
    assert "cluster pair: all-reduce of 0.00 GB (gloo, 2 members)" in result.stdout


def test_a_member_formed_into_another_cluster_stops_both_before_any_all_reduce(tmp_path, run_playbook):
    port = free_port()
    playbook, inventory = fleet(tmp_path, {"m0": {}, "m1": {"P40FLEET_RAY_CLUSTER": "other"}}, port)
    result = run_playbook(playbook, inventory, extra_vars={**SMALL, "ray_cluster_network_port": port}, envvars=ROOT)
    failed = {f.host: f.message for f in result.failures}
    assert set(failed) == {"m0", "m1"}, result.stdout[-3000:]
    for message in failed.values():
        assert "names another cluster or none on m1 (other): run playbooks/cluster.yml first" in message
    assert not (tmp_path / "m0.json").exists()


def test_qualify_skips_a_cluster_not_formed_yet_and_says_so(tmp_path, run_playbook):
    port = free_port()
    playbook, inventory = fleet(tmp_path, {"m0": None, "m1": None}, port)
    extra = {**SMALL, "ray_cluster_network_port": port, "ray_cluster_network_unformed": "skip"}
    result = run_playbook(playbook, inventory, extra_vars=extra, envvars=ROOT)
    assert not result.failures, result.stdout[-3000:]
    for host in ("m0", "m1"):
        published = json.loads((tmp_path / f"{host}.json").read_text())
        assert published["verdict"] == "skip" and "cluster pair: not formed yet" in published["message"]


def test_a_head_whose_firewall_leaves_the_meeting_port_open_is_refused(tmp_path, run_playbook):
    """A cluster formed before the port joined the firewall: the all-reduce would meet on a port anyone reaches."""
    port = free_port()
    playbook, inventory = fleet(tmp_path, {"m0": {}, "m1": {}}, None)
    result = run_playbook(playbook, inventory, extra_vars={**SMALL, "ray_cluster_network_port": port}, envvars=ROOT)
    failed = {f.host: f.message for f in result.failures}
    assert set(failed) == {"m0", "m1"}, result.stdout[-3000:]
    assert (
        f"m1: cluster pair: the firewall of the head m0 (/etc/p40fleet/ray/firewall.nft) does not name port {port} "
        "among the ports only members may reach: run playbooks/cluster.yml, which adds it"
    ) in failed["m1"]
