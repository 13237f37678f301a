"""P40FLEET_MITOGEN: the opt-in that runs playbooks with mitogen's strategy, without containers."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from p40fleet import run


@pytest.fixture
def mitogen_installed(monkeypatch, tmp_path) -> Path:
    package = tmp_path / "ansible_mitogen"
    origin = package / "__init__.py"
    monkeypatch.setattr(
        run.importlib.util,
        "find_spec",
        lambda name: SimpleNamespace(origin=str(origin)) if name == "ansible_mitogen" else None,
    )
    return package / "plugins" / "strategy"


@pytest.fixture
def mitogen_missing(monkeypatch) -> None:
    monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", " off "])
def test_off_unless_asked_for_even_when_installed(mitogen_installed, value):
    environ = {} if value is None else {"P40FLEET_MITOGEN": value}
    assert run.mitogen_envvars(environ) == {}


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_asked_for_selects_the_installed_strategy(mitogen_installed, value):
    assert run.mitogen_envvars({"P40FLEET_MITOGEN": value}) == {
        "ANSIBLE_STRATEGY_PLUGINS": str(mitogen_installed),
        "ANSIBLE_STRATEGY": "mitogen_linear",
    }


def test_asked_for_but_not_installed_says_how_to_install(mitogen_missing):
    with pytest.raises(run.RunError, match=r"P40FLEET_MITOGEN=1 asks for mitogen, which is not installed here: pip"):
        run.mitogen_envvars({"P40FLEET_MITOGEN": "1"})


@pytest.mark.parametrize("value", ["2", "mitogen", "enabled"])
def test_an_unknown_value_is_refused_by_name(mitogen_installed, value):
    with pytest.raises(run.RunError, match=rf"P40FLEET_MITOGEN='{value}': set it to 1 .* or to 0"):
        run.mitogen_envvars({"P40FLEET_MITOGEN": value})


def test_off_by_default_needs_no_mitogen(mitogen_missing, monkeypatch):
    monkeypatch.delenv("P40FLEET_MITOGEN", raising=False)
    assert run.mitogen_envvars() == {}
