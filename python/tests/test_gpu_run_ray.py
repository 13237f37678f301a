"""The GPU check's copies of a rendered launch script each get a Ray of their own (tests/gpu/run_check.py own_ray): the
script starts its head on 127.0.0.1 at fixed ports in a directory of the owner's (docs/ray-single-host.md), so the
learning proof's runs, side by side on one machine, must each move every port and the directory, or the second run
would join the first one's Ray."""

from __future__ import annotations

import re
import sys

import pytest

from p40fleet_dev.paths import REPO_ROOT
from tests.launch_render import preflight_profile, render

sys.path.insert(0, str(REPO_ROOT / "python" / "tests" / "gpu"))
# A script on the GPU machine, imported as the learning tests import it.
import run_check

PORT = re.compile(r"(?:port|PORT)=\"?(\d+)")


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    rendered, _ = render(
        {"p40": {"profile": preflight_profile("Tesla P40", "6.1", 23040, 1)}}, tmp_path_factory.mktemp("ray")
    )
    return rendered["p40"].script.read_text()


def ports(text: str) -> list[int]:
    return [int(p) for p in PORT.findall(text)]


def test_every_port_and_the_directory_move(script, tmp_path):
    before = ports(script)
    assert len(before) >= 10, before
    moved = run_check.own_ray(script, tmp_path / ".ray", 3)
    assert ports(moved) == [p + 3000 for p in before]
    assert f"readonly RAY_DIR={tmp_path / '.ray'}\n" in moved
    # Two runs side by side share no port.
    assert not set(ports(run_check.own_ray(script, tmp_path, 1))) & set(ports(run_check.own_ray(script, tmp_path, 2)))


def test_the_first_run_keeps_the_rendered_ports(script, tmp_path):
    assert ports(run_check.own_ray(script, tmp_path, 0)) == ports(script)
