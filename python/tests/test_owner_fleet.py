"""A fleet provisioned for a non-default env owner (p40fleet_env_owner: trainer), from a fresh host, over real SSH
(issues 58 and 59): every stage acts for that owner and no `p40fleet` account is made; a re-run and
`p40fleet report --refresh` find it converged; another owner is refused before any account is made; `p40fleet
qualify` fails a host whose owner has no account, with the owner's name and a non-zero exit.

The host is converged_image's variant with that owner (built once, minutes; then reused while nothing it depends on
changes). `qualify` and `train` with that owner on GPU stand-ins are not run here (test_gpu_qualify.py and
test_train_run.py run them for the default owner).
"""

from __future__ import annotations

import pytest
import yaml

from p40fleet import api, cli
from p40fleet_dev import images
from tests.test_state_refresh import drift

pytestmark = [pytest.mark.sandbox, pytest.mark.converge]

OWNER = "trainer"
DEFAULT_OWNER = "p40fleet"
PREFIX = "/opt/miniconda3"


@pytest.fixture(scope="module")
def fleet(make_sandbox):
    image = images.converged_image(profile="p40", login="root", extra_vars={"p40fleet_env_owner": OWNER})
    fleet = make_sandbox("owner", ["p40"], login="root", image=image)
    (fleet.inventory_dir / "group_vars" / "all.yml").write_text(
        "---\n# The fleet's env owner, one setting for every command.\n" + yaml.safe_dump({"p40fleet_env_owner": OWNER})
    )
    return fleet


def account(fleet, name: str) -> bool:
    return fleet.exec("node1", f"getent passwd {name}").returncode == 0


def owner_of(fleet, path: str) -> str:
    return fleet.exec("node1", f"stat -c %U {path}").stdout.strip()


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


def test_qualify_fails_a_host_without_the_owners_account(fleet, tmp_path, capsys):
    inventory = str(fleet.inventory_dir / "hosts.yml")
    argv = ["qualify", "-i", inventory, "--state-dir", str(tmp_path), "-e", f"p40fleet_env_owner={DEFAULT_OWNER}"]
    code = cli.main(argv)
    captured = capsys.readouterr()
    out = " ".join((captured.out + captured.err).split())
    assert code == cli.EXIT_HOSTS_FAILED, out
    assert 'node1: qualify stopped at "Refuse a host without the env owner\'s account"' in out, out
    assert f"the env owner '{DEFAULT_OWNER}' (p40fleet_env_owner), who runs the qualification's load" in out, out
    assert not account(fleet, DEFAULT_OWNER)
