"""conda_env's decisions (install Miniconda, create the env, anything to do at all), without containers
(plugins/filter/conda_env.py).

The findings are the key=value lines of the role's two probes, as strings; each situation is paired with its
decisions. The sandbox tests (test_python_stack.py, the fault suite's case 1) prove the wiring on hosts.
"""

from __future__ import annotations

import hashlib

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.source_modules import load_module

FILTERS = load_module(REPO_ROOT / "plugins" / "filter" / "conda_env.py", "conda_env_filter")
PLAN = FILTERS.conda_env_plan
SHA = "aef279d6baea7f67940f16aad17ebe5f6aac97487c7c03466ff01f4819e5a651"
CONDARC = "always_yes: true\nchannels:\n- conda-forge\n"
SETTINGS = {"installer_sha256": SHA.upper(), "python_version": "3.10", "condarc": CONDARC, "owner": "p40fleet"}
CONVERGED = {
    "owner": "yes",
    "installed_sha256": SHA,
    "condarc_sha1": hashlib.sha1(CONDARC.encode()).hexdigest(),
    "env_dir": "yes",
    "env_owner": "p40fleet",
    "creating": "",
    "conda": "conda 23.3.1",
    "env_python": "3.10",
}
FRESH = {**dict.fromkeys(CONVERGED, ""), "conda": "", "env_python": ""}

# situation: (found, (install_miniconda, create_env, install_needed))
CASES = {
    "converged": (CONVERGED, (False, False, False)),
    "fresh_host": (FRESH, (True, True, True)),
    "another_installer_made_the_prefix": ({**CONVERGED, "installed_sha256": "0" * 64}, (True, False, True)),
    "conda_does_not_run": ({**CONVERGED, "conda": ""}, (True, False, True)),
    "env_missing": ({**CONVERGED, "env_dir": "", "env_owner": "", "env_python": ""}, (False, True, True)),
    "env_with_another_python": ({**CONVERGED, "env_python": "3.11"}, (False, True, True)),
    # A create killed after the env's python was in place: its python runs, the marker says unfinished.
    "create_left_unfinished": ({**CONVERGED, "creating": "yes"}, (False, True, True)),
    "condarc_changed": ({**CONVERGED, "condarc_sha1": "0" * 40}, (False, False, True)),
    "env_owned_by_someone_else": ({**CONVERGED, "env_owner": "root"}, (False, False, True)),
    "owner_missing": ({**CONVERGED, "owner": ""}, (False, False, True)),
}


@pytest.mark.parametrize("situation", sorted(CASES))
def test_each_situation_gets_its_decisions(situation):
    found, (install_miniconda, create_env, install_needed) = CASES[situation]
    assert PLAN(found, SETTINGS) == {
        "install_miniconda": install_miniconda,
        "create_env": create_env,
        "install_needed": install_needed,
    }


def test_the_role_wires_the_filter():
    converge = (REPO_ROOT / "roles" / "conda_env" / "tasks" / "probe.yml").read_text()
    assert "conda_env_probed | p40fleet.fleet.conda_env_plan(" in converge
    assert "conda_env_owner_probe.stdout_lines | default([]) | p40fleet.fleet.conda_env_owner_found" in converge


@pytest.mark.parametrize(
    ("lines", "found"),
    [
        (["conda=conda 23.3.1", "env_python=3.10"], {"conda": "conda 23.3.1", "env_python": "3.10"}),
        (["conda=", "env_python="], {"conda": "", "env_python": ""}),
        ([], {"conda": "", "env_python": ""}),
        # A regression: the owner's lines were combined over root's, so it could print root's findings.
        (
            ["conda=conda 23.3.1", "env_python=3.10", f"installed_sha256={SHA}", "env_owner=p40fleet", "creating="],
            {"conda": "conda 23.3.1", "env_python": "3.10"},
        ),
        (["conda=conda 23.3.1; owner=yes", "env_python=3.10/../../etc"], {"conda": "", "env_python": ""}),
        (["env_python=3.10", "env_python=3.11"], {"conda": "", "env_python": "3.10"}),
        ("conda=conda 23.3.1", {"conda": "", "env_python": ""}),
    ],
)
def test_the_owners_probe_gives_its_two_fields_only_each_in_its_shape(lines, found):
    assert FILTERS.conda_env_owner_found(lines) == found


def test_the_owner_cannot_stand_in_for_roots_findings():
    # Root found the prefix made by another installer and a changed .condarc; the owner claims all is well.
    roots = {**CONVERGED, "installed_sha256": "0" * 64, "condarc_sha1": "0" * 40}
    roots = {k: v for k, v in roots.items() if k not in ("conda", "env_python")}
    forged = [
        "conda=conda 23.3.1",
        "env_python=3.10",
        f"installed_sha256={SHA}",
        f"condarc_sha1={CONVERGED['condarc_sha1']}",
    ]
    found = {**roots, **FILTERS.conda_env_owner_found(forged)}
    assert PLAN(found, SETTINGS) == {"install_miniconda": True, "create_env": False, "install_needed": True}


@pytest.mark.parametrize(
    ("miniconda_version", "python"),
    [
        ("py310_23.3.1-0", "3.10"),
        ("py39_4.12.0", "3.9"),
        ("py312_24.7.1-0", "3.12"),
        ("py311_standin", "3.11"),
        ("latest", ""),
        ("23.3.1-0", ""),
        ("py3_x", ""),
        ("py310", ""),
    ],
)
def test_the_installers_python_is_read_from_its_release_name(miniconda_version, python):
    """The env is cloned from the installer's own Python: conda_env refuses an env Python the installer lacks."""
    assert FILTERS.conda_env_installer_python(miniconda_version) == python


REFUSAL = FILTERS.conda_env_owner_refusal


@pytest.mark.parametrize(
    ("found", "refused_for"),
    [
        ({**CONVERGED, "prefix_owner": "p40fleet"}, None),
        (FRESH, None),
        # A prefix made by hand (root's, empty) or one with no env yet is not another owner's.
        ({**FRESH, "prefix_owner": "root"}, None),
        ({**CONVERGED, "prefix_owner": "root", "env_owner": "root"}, None),
        # Provisioned for p40fleet, now asked for trainer: refused, naming the owner it was made for.
        ({**CONVERGED, "prefix_owner": "p40fleet"}, "trainer"),
        ({**FRESH, "prefix_owner": "p40fleet"}, "trainer"),
        ({**CONVERGED, "prefix_owner": "root"}, "trainer"),
    ],
)
def test_a_host_provisioned_for_another_owner_is_refused_before_any_account(found, refused_for):
    owner = refused_for or "p40fleet"
    message = REFUSAL(found, owner, "/opt/miniconda3", "node1")
    if refused_for is None:
        assert message == ""
        return
    assert message.startswith("node1: /opt/miniconda3 was provisioned for the env owner 'p40fleet', but the env ")
    assert f"owner is now '{owner}' (p40fleet_env_owner)" in message
    assert "no account was made" in message and "set p40fleet_env_owner back to 'p40fleet'" in message


def test_the_refusal_comes_before_the_owners_account_is_made():
    probe = (REPO_ROOT / "roles" / "conda_env" / "tasks" / "probe.yml").read_text()
    main = (REPO_ROOT / "roles" / "conda_env" / "tasks" / "main.yml").read_text()
    assert "conda_env_owner_refusal(conda_env_owner, conda_env_install_prefix" in probe
    assert 'echo "prefix_owner=$(stat -c %U' in probe
    # probe.yml (the refusal) is included before install.yml (ansible.builtin.user).
    assert main.index("probe.yml") < main.index("install.yml")
