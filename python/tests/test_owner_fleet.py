"""A fleet provisioned for a non-default env owner (p40fleet_env_owner: trainer), from a fresh host, over real SSH
(issues 58 and 59): every stage acts for that owner and no `p40fleet` account is made; a re-run and
`p40fleet report --refresh` find it converged; another owner is refused before any account is made. Then the day's
other commands, as docs/dev/sandbox.md types them (`p40fleet qualify|train ... -i INVENTORY`), on the stand-ins
`sandbox up --services` puts on a host (p40fleet_dev.standins: root's nvidia-smi answering as a recorded P40, verl's
trainer, the service manager): `qualify` passes with its load run as `trainer`, and `train start` runs a training
run as `trainer` that `train status` follows to its end, both seen from the host (what the load and the run made is
trainer's; nothing is made for `p40fleet`). Bad inputs get their documented exit codes (docs/cli.md) and say the
host, what was found and what to do: a limit that matches no host (4, before contact), a host whose owner setting is
not the one it was provisioned for (`train start`: 2) or has no account (`qualify`: 2).

The host is converged_image's variant with that owner (built once, minutes; then reused while nothing it depends on
changes), started with the stand-in service manager.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from p40fleet import api, cli
from p40fleet_dev import images, standins
from tests.test_state_refresh import drift

pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

OWNER = "trainer"
DEFAULT_OWNER = "p40fleet"
PREFIX = "/opt/miniconda3"
# The load's stand-in leaves a file of its own: whose it is, root's stat says (nothing the load prints is read).
LOAD_MARK = "/tmp/p40fleet-qualify-load"
LOAD = f"import sys, time; open({LOAD_MARK!r}, 'w').close(); time.sleep(float(sys.argv[-1]))"
STEPS = 8
# `sandbox up --services`' inventory variables, with a shorter run (8 steps of a second) and the marking load.
OPERATOR_VARS = {
    **standins.OPERATOR_VARS,
    "train_run_command": [
        *("/usr/bin/python3", standins.TRAINER_ON_HOST, f"trainer.total_training_steps={STEPS}"),
        *("trainer.save_freq=4", "trainer.test_freq=4", "+standin.step_seconds=1"),
    ],
    "gpu_qualify_load_command": ["/usr/bin/python3", "-I", "-c", LOAD],
}


@pytest.fixture(scope="module")
def fleet(make_sandbox):
    image = images.converged_image(profile="p40", login="root", extra_vars={"p40fleet_env_owner": OWNER})
    fleet = make_sandbox("owner", ["p40"], login="root", image=image, services=True)
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
    """`p40fleet ARGV -i <the fleet's inventory>` as docs/dev/sandbox.md types it (the state in `state`): its exit
    code and what it said, on one line."""
    monkeypatch.setenv("COLUMNS", "400")  # nothing cut or folded at 80 columns
    code = cli.main([*argv, "-i", str(fleet.inventory_dir), "--state-dir", str(state)])
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def nothing_for_the_default_owner(fleet) -> bool:
    return not account(fleet, DEFAULT_OWNER) and fleet.exec("node1", f"test -e /home/{DEFAULT_OWNER}").returncode != 0


def test_every_stage_acted_for_the_owner_and_a_rerun_and_refresh_find_it_converged(fleet, tmp_path):
    assert account(fleet, OWNER) and not account(fleet, DEFAULT_OWNER)
    assert owner_of(fleet, f"{PREFIX}/envs/verl-env") == OWNER
    assert owner_of(fleet, f"/home/{OWNER}/train_gsm8k_ppo.sh") == OWNER

    run = api.provision(fleet.inventory_dir, state_dir=tmp_path)
    assert run.exit_code == 0, [f.message for h in run.hosts.values() for f in h.failures]
    assert run.hosts["node1"].stats.changed == 0, run.hosts["node1"]
    refreshed = api.refresh_state(fleet.inventory_dir, state_dir=tmp_path)
    assert refreshed.exit_code == 0 and drift(refreshed) == {}


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


def test_a_training_run_runs_as_the_owner_to_its_end(fleet, tmp_path, capsys, monkeypatch):
    code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, "train", "start")
    assert code == cli.EXIT_OK and "node1 gsm8k: running" in out, out
    unit = fleet.exec("node1", "grep -x 'User=.*' /etc/systemd/system/p40fleet-train-gsm8k.service").stdout
    assert unit.split() == [f"User={OWNER}"]

    log = f"/home/{OWNER}/.p40fleet/train/gsm8k.log"
    deadline = time.monotonic() + 120
    code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, "train", "status")
    while not re.search("node1 gsm8k: (finished|failed)", out):
        assert time.monotonic() < deadline, out
        time.sleep(2)
        code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, "train", "status")
    journal = "/var/log/p40fleet-standin-systemd/p40fleet-train-gsm8k.service.log"
    assert code == cli.EXIT_OK, (out, fleet.exec("node1", f"tail -n 20 {log} {journal}").stdout)
    assert f"node1 gsm8k: finished · step {STEPS} of {STEPS} · " in out and f"node1:{log}" in out, out
    # What the run made is the owner's, seen from the host; nothing is the default owner's.
    checkpoints = f"/home/{OWNER}/standin-checkpoints"
    assert [owner_of(fleet, p) for p in (log, checkpoints, f"{checkpoints}/global_step_{STEPS}")] == [OWNER] * 3
    assert fleet.exec("node1", f"cat {checkpoints}/latest_checkpointed_iteration.txt").stdout == str(STEPS)
    assert fleet.exec("node1", f"grep -c '^step:' {log}").stdout.strip() == str(STEPS)
    assert nothing_for_the_default_owner(fleet)


def test_a_limit_that_matches_no_host_is_refused_before_contact(fleet, tmp_path, capsys, monkeypatch):
    inventory = fleet.inventory_dir.resolve()
    for argv in (["qualify"], ["train", "start"]):
        code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, *argv, "-l", "node9")
        assert code == cli.EXIT_BAD_INPUT, (argv, out)
        assert (
            f"the limit 'node9' matches no host of {inventory}: name a host or group it has "
            f"(`ansible-inventory -i {inventory} --graph` lists them)"
        ) in out, (argv, out)


def test_train_start_refuses_a_host_provisioned_for_another_owner(fleet, tmp_path, capsys, monkeypatch):
    host_vars = fleet.inventory_dir / "host_vars"
    host_vars.mkdir(exist_ok=True)
    (host_vars / "node1.yml").write_text(yaml.safe_dump({"p40fleet_env_owner": DEFAULT_OWNER}))
    try:
        code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, "train", "start", "--name", "other")
    finally:
        (host_vars / "node1.yml").unlink()
    assert code == cli.EXIT_HOSTS_FAILED, out
    assert (
        f"node1: {PREFIX} was provisioned for the env owner '{OWNER}', but the env owner is now '{DEFAULT_OWNER}' "
        f"(p40fleet_env_owner)."
    ) in out, out
    assert f"Do: set p40fleet_env_owner back to '{OWNER}'" in out, out
    assert fleet.exec("node1", "test -e /etc/systemd/system/p40fleet-train-other.service").returncode == 1
    assert nothing_for_the_default_owner(fleet)


def test_qualify_fails_a_host_without_the_owners_account(fleet, tmp_path, capsys, monkeypatch):
    argv = ["qualify", "-e", f"p40fleet_env_owner={DEFAULT_OWNER}"]
    code, out = p40fleet(fleet, tmp_path, capsys, monkeypatch, *argv)
    assert code == cli.EXIT_HOSTS_FAILED, out
    assert 'node1: qualify stopped at "Refuse a host without the env owner\'s account"' in out, out
    assert f"the env owner '{DEFAULT_OWNER}' (p40fleet_env_owner), who runs the qualification's load" in out, out
    assert "Do: set p40fleet_env_owner in the inventory to the owner this fleet was provisioned with" in out, out
    assert nothing_for_the_default_owner(fleet)
