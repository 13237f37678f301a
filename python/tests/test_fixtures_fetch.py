"""How `python -m p40fleet_dev fixtures` groups upstream.txt's lines into pip calls (no network)."""

from __future__ import annotations

import pytest

from p40fleet_dev.fixtures import pip_rounds, upstream_requirements


@pytest.mark.parametrize(
    ("entries", "rounds"),
    [
        ([], []),
        ([("wheel", "a==1"), ("wheel", "b==2")], [("wheel", ["a==1", "b==2"])]),
        # One call a kind, whatever the order of the lines.
        (
            [("sdist", "verl==0.4.1"), ("wheel", "a==1"), ("wheel", "b==2")],
            [("sdist", ["verl==0.4.1"]), ("wheel", ["a==1", "b==2"])],
        ),
        # A name again (as PyPI spells it or not) is another call: pip refuses two versions of one project.
        (
            [("sdist", "verl==0.4.1"), ("sdist", "verl==0.5.0"), ("sdist", "verl==0.4.0")],
            [("sdist", ["verl==0.4.1"]), ("sdist", ["verl==0.5.0"]), ("sdist", ["verl==0.4.0"])],
        ),
        (
            [("wheel", "PyYAML==6.0.2"), ("wheel", "pyyaml==6.0.1"), ("wheel", "typing_extensions==4.12.2")],
            [("wheel", ["PyYAML==6.0.2", "typing_extensions==4.12.2"]), ("wheel", ["pyyaml==6.0.1"])],
        ),
        (
            [("wheel", "typing_extensions==4.12.2"), ("wheel", "typing-extensions==4.12.1")],
            [("wheel", ["typing_extensions==4.12.2"]), ("wheel", ["typing-extensions==4.12.1"])],
        ),
        # The same name as a wheel and as an sdist: one call of each kind.
        (
            [("wheel", "verl==0.4.1"), ("sdist", "verl==0.4.1")],
            [("wheel", ["verl==0.4.1"]), ("sdist", ["verl==0.4.1"])],
        ),
    ],
)
def test_one_pip_call_a_kind_and_another_where_a_name_comes_again(entries, rounds):
    assert pip_rounds(entries) == rounds


def test_the_listed_files_take_five_pip_calls_and_none_is_lost():
    entries = upstream_requirements()
    rounds = pip_rounds(entries)
    # verl's three sdists and two wheels are the only names listed more than once.
    assert len(rounds) == 5
    assert sorted((kind, r) for kind, requirements in rounds for r in requirements) == sorted(entries)
