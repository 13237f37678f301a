"""Case 10: a Hugging Face token and a sudo password, given for a run, are nowhere the run leaves a trace.

The run is node1's first converge (conftest's first_converge): `p40fleet run --report` logging in as `ops`
with the sandbox's sudo password as a file (`--become-password-file`), and a token made for this session in
host_vars, which the Hub stand-in needs to serve the gated model. While it went, every process's arguments
were sampled on the controller (its /proc also lists the hosts' processes) and on node1 (`ps` there). Then
the runner's artifacts, the report, the console, the fact cache, the sandbox's files and ansible's own
directories on the controller, and every file on node1, are searched for both.
(test_login_modes.py, test_training_data.py and test_launch_script.py search the runner artifacts of runs that
use one secret each.)
"""

from __future__ import annotations

import http.client
import json
import secrets
import shutil
import socket
import ssl
from pathlib import Path

import pytest
from tests.faults.tools import MODEL_REPO, find_files_holding, host_files_holding

from p40fleet_dev.sandbox import APT_HOSTNAME

pytestmark = [pytest.mark.sandbox, pytest.mark.fault_case(10)]


def hub_status(hub, ca: str, token: str | None) -> int:
    """The status the sandbox's https Hub answers the controller: by the mirror's address, its certificate checked
    for the name the hosts use."""
    context = ssl.create_default_context(cadata=ca)
    raw = socket.create_connection((hub.address, hub.port), timeout=10)
    connection = http.client.HTTPConnection(APT_HOSTNAME, hub.port, timeout=10)
    connection.sock = context.wrap_socket(raw, server_hostname=APT_HOSTNAME)
    try:
        connection.request(
            "GET", f"/api/models/{MODEL_REPO}", headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        return connection.getresponse().status
    finally:
        connection.close()


def test_both_secrets_were_given_and_used(fleet, first_converge):
    run = first_converge
    assert run.code == 0, run.console[-4000:]
    # The model is gated: only the run's token could have fetched it.
    ca = fleet.sandbox.hub_ca()
    assert hub_status(run.hub, ca, None) == 401
    assert hub_status(run.hub, ca, run.token) == 200
    assert fleet.exists("node1", "/opt/p40fleet/models/Qwen2.5-0.5B-Instruct/model.safetensors")
    # sudo asked for the password: the sandbox's ops may not sudo without one.
    assert fleet.exec("node1", "sudo -n true", user="ops").returncode != 0
    report = json.loads(run.report_path.read_text())
    assert report["runs"][0]["hosts"]["node1"]["state"] == "changed"


def test_no_process_list_showed_either_secret(first_converge):
    sampler = first_converge.sampler
    # The sampler watched the whole run, while both secrets were in use.
    assert sampler.samples > 200 and sampler.host_samples > 20, (sampler.samples, sampler.host_samples)
    assert sampler.saw(b"ansible-playbook")
    assert sampler.saw(b"sudo -H -S")  # become with a password: sudo reads it on its stdin
    assert sampler.saw(b"training_data_hub.py")  # the throwaway account's hub downloads: the token's one step
    assert sampler.hits == []


def test_no_file_on_the_controller_holds_either_secret(fleet, first_converge):
    run = first_converge
    assert run.run_dirs, "the run left no runner directory to search"
    assert any(p.name == "stdout" for d in run.run_dirs for p in d.rglob("*"))
    given = {fleet.inventory / "host_vars" / "node1.yml", fleet.password_file}  # the user's own inputs
    places = [*run.run_dirs, run.report_path, fleet.sandbox.dir, Path.home() / ".ansible"]
    # The search finds what is there: a file two directories down, and nothing the skip list names.
    planted = secrets.token_hex(16).encode()
    probe = fleet.sandbox.dir / "faults-probe" / "deeper" / "file"
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"x" + planted + b"x")
    try:
        assert find_files_holding(places, [planted], skip=given) == [str(probe)]
        assert find_files_holding(places, [planted], skip={*given, probe}) == []
    finally:
        shutil.rmtree(probe.parent.parent)
    assert find_files_holding(places, [run.token.encode(), run.password.encode()], skip=given) == []
    assert run.token not in run.console and run.password not in run.console
    assert "node1" in run.console  # the console output searched is the run's


def test_no_file_on_the_host_holds_either_secret(fleet, first_converge):
    run = first_converge
    # The search finds what is there: a file planted as root in a 0700 directory.
    planted, probe = secrets.token_hex(16), "/root/p40fleet-faults-probe"
    fleet.sh("node1", f"printf 'x%sx' {planted} > {probe}")
    assert host_files_holding(fleet.sandbox, "node1", [planted]) == [probe]
    fleet.sh("node1", f"rm {probe}")
    assert host_files_holding(fleet.sandbox, "node1", [run.token, run.password]) == []
