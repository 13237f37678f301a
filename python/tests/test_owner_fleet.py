"""A fleet provisioned for a non-default env owner (p40fleet_env_owner: trainer), from a fresh host, over real SSH
(issues 58 and 59): every stage acted for that owner and no `p40fleet` account was made; another owner is refused
before any account is made. Then `p40fleet qualify`, on the stand-ins `sandbox up --services` puts on a host
(p40fleet_dev.standins: root's nvidia-smi answering as a recorded P40, the service manager), passes with its load
run as `trainer` (what the load made is trainer's, seen from the host; nothing is made for `p40fleet`), and fails a
host whose owner setting names an account it does not have (exit 2, naming the host, what was found, what to do).

The host is converged_image's variant with that owner (p40fleet_dev.images.owner_image), started with the stand-in
service manager: test_collection.py's host, converged for that owner by the installed collection, where that module ran
first in this work unit (images.publish_owner), else built from a fresh host (this module run alone). The rest of that
owner's day, from the docs as an operator types it, is test_sandbox_docs.py's, on a copy of the same image: the re-run
changing nothing, `report --refresh` without drift, train start, status, stop and resume as `trainer`, and the bad
inputs (a limit matching no host, a misspelled or out-of-range `-e`, `train start` for another owner).
"""

from __future__ import annotations

import json

import pytest
import yaml

from p40fleet import api, cli
from p40fleet_dev import images, standins

# The owner image is test_collection.py's converge where that module ran first in this unit (images.publish_owner).
pytestmark = [pytest.mark.sandbox, pytest.mark.converge, pytest.mark.xdist_group("owner-image")]

OWNER = "trainer"
DEFAULT_OWNER = "p40fleet"
PREFIX = "/opt/miniconda3"
# The load's stand-in leaves a file of its own: whose it is, root's stat says (nothing the load prints is read).
LOAD_MARK = "/tmp/p40fleet-qualify-load"
LOAD = f"import sys, time; open({LOAD_MARK!r}, 'w').close(); time.sleep(float(sys.argv[-1]))"
# `sandbox up --services`' inventory variables, with the marking load.
OPERATOR_VARS = {**standins.OPERATOR_VARS, "gpu_qualify_load_command": ["/usr/bin/python3", "-I", "-c", LOAD]}


@pytest.fixture(scope="module")
def fleet(make_sandbox):
    fleet = make_sandbox("owner", ["p40"], login="root", image=images.owner_image(OWNER), services=True)
    standins.install_operator_standins(fleet, "node1", owner=OWNER)
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(
        "---\n# The fleet's env owner, one setting for every command; the stand-ins of `sandbox up --services`.\n"
        + yaml.safe_dump({"p40fleet_env_owner": OWNER, **OPERATOR_VARS})
    )
    return fleet


def account(fleet, name: str) -> bool:
    return fleet.exec("node1", f"getent passwd {name}").returncode == 0


def owner_of(fleet, path: str) -> str:
    return fleet.exec("node1", f"stat -c %U {path}").stdout.strip()


def p40fleet(fleet, state, capsys, monkeypatch, *argv: str) -> tuple[int, str]:
    """`p40fleet ARGV -i <the fleet's inventory>` as docs/dev/sandbox-day.md types it (the state in `state`): its exit
    code and what it said, on one line."""
    monkeypatch.setenv("COLUMNS", "400")  # nothing cut or folded at 80 columns
    code = cli.main([*argv, "-i", str(fleet.inventory_dir), "--state-dir", str(state)])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def nothing_for_the_default_owner(fleet) -> bool:
    return not account(fleet, DEFAULT_OWNER) and fleet.exec("node1", f"test -e /home/{DEFAULT_OWNER}").returncode != 0


def test_every_stage_acted_for_the_owner(fleet):
    assert account(fleet, OWNER) and not account(fleet, DEFAULT_OWNER)
    assert owner_of(fleet, f"{PREFIX}/envs/verl-env") == OWNER
    assert owner_of(fleet, f"/home/{OWNER}/train_gsm8k_ppo.sh") == OWNER


def test_another_owner_is_refused_before_any_account_is_made(fleet, tmp_path):
    run = api.provision(fleet.inventory_dir, state_dir=tmp_path, extra_vars={"p40fleet_env_owner": DEFAULT_OWNER})
    assert run.exit_code == api.EXIT_HOSTS_FAILED, run
    (failure,) = run.hosts["node1"].failures
    assert failure.role == "conda_env", failure
    assert failure.message.startswith(
        f"node1: {PREFIX} was provisioned for the env owner '{OWNER}', but the env owner is now '{DEFAULT_OWNER}'"
    ), failure.message
    assert not account(fleet, DEFAULT_OWNER)


def test_qualify_passes_with_its_load_run_as_the_owner(fleet, tmp_path, capsys, monkeypatch):
    code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, "qualify")
    assert code == cli.EXIT_OK, out
    history = cli.qualify_history_path(tmp_path, fleet.inventory_dir)
    assert f"this run's verdicts and host failures are kept in {history}" in out, out
    [card] = [c["last"] for c in json.loads(history.read_text())["cards"].values()]
    assert (card["host"], card["verdict"], card["reasons"]) == ("node1", "pass", [])
    assert card["summary"]["loaded_samples"] >= 3, card["summary"]
    assert owner_of(fleet, LOAD_MARK) == OWNER
    assert nothing_for_the_default_owner(fleet)


def test_qualify_fails_a_host_without_the_owners_account(fleet, tmp_path, capsys, monkeypatch):
    argv = ["qualify", "-e", f"p40fleet_env_owner={DEFAULT_OWNER}"]
    code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, *argv)
    assert code == cli.EXIT_HOSTS_FAILED, out
    assert 'node1: qualify stopped at "Refuse a host without the env owner\'s account"' in out, out
    assert f"the env owner '{DEFAULT_OWNER}' (p40fleet_env_owner), who runs the qualification's load" in out, out
    assert "Do: set p40fleet_env_owner in the inventory to the owner this fleet was provisioned with" in out, out
    assert nothing_for_the_default_owner(fleet)
