"""docs/dev/sandbox.md's recipe for qualify and train, run as written: its commands are read from the Markdown (the sh
block of "## Qualify and train") and run one by one from the checkout's root, as an operator types them, through
this checkout's `python` and `p40fleet`. Only the sandbox's name is the test's own (`try` -> a pytest name, so
sessions side by side do not share a fleet); the state directory is a temporary one (P40FLEET_STATE_DIR). Each
command must exit 0 and say what the recipe promises: the stand-ins named as such, a verdict per card, the run
running, followed, stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from p40fleet_dev import standins
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import Sandbox, SandboxError
from tests import sandbox_removal
from tests.workers import sandbox_name

DOC = REPO_ROOT / "docs/dev/sandbox.md"
DOC_NAME = "try"

# What each command of the recipe must print, by its words (the sandbox's name left out).
PROMISED = {
    "python -m p40fleet_dev sandbox up": [
        r"Stand-ins on every host \(test fixtures, not the real programs",
        r"systemctl +a stand-in service manager",
        r"trainer +a stand-in for verl's trainer",
        r"qualify +a stand-in nvidia-smi answering as recorded card p40-healthy",
    ],
    "p40fleet qualify": [r"exit 0: ok", r"this run's verdicts and host failures are kept in .*gpu-qualify\.json"],
    "p40fleet report": [r"node1 GPU 0 serial \S+-node1 \(Tesla P40\): pass"],
    "p40fleet train start": [r"node1 gsm8k: running"],
    "p40fleet train status": [r"node1 gsm8k: running · step \d+ of 40"],
    "p40fleet train stop": [r"node1 gsm8k: stopped", r"node1: stopped by `p40fleet train stop`; `start` resumes it"],
    "python -m p40fleet_dev sandbox down": [r"Sandbox \S+ removed\."],
}


def recipe() -> list[str]:
    """The commands of the sh block under "## Qualify and train", in order, comments left out."""
    section = DOC.read_text(encoding="utf-8").split("\n## Qualify and train\n", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"^```sh\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    return [line for line in block.splitlines() if shlex.split(line, comments=True)]


def promised(argv: list[str]) -> list[str]:
    words = " ".join(argv)
    [key] = [key for key in PROMISED if words.startswith(key + " ")]
    return PROMISED[key]


def test_the_recipe_is_every_step_the_test_checks():
    """Each command of the recipe has its promise here, and each promise its command (no container)."""
    commands = [" ".join(shlex.split(line, comments=True)) for line in recipe()]
    assert [next(k for k in PROMISED if c.startswith(k + " ")) for c in commands] == list(PROMISED)


def test_the_stand_ins_need_the_service_manager_and_a_recorded_card():
    """Refused before anything starts (no container): stand-ins without the service manager, an unknown card."""
    with pytest.raises(SandboxError, match="need the stand-in service manager"):
        Sandbox("pytest-never-started").up(["p40"], standins=True)
    with pytest.raises(ValueError, match="no recorded card 'p40-nothing'; recorded: p40-ecc-errors, "):
        standins.give_card(None, "node1", "p40-nothing")
    assert standins.DEFAULT_CARD in standins.card_names()


@pytest.mark.sandbox
def test_the_recipe_for_qualify_and_train_runs_as_written(tmp_path):
    name = sandbox_name("docs")
    sandbox_removal.session.claim(name)
    sandbox_removal.session.keep_until_unit_ends(Sandbox(name))
    env = {
        **os.environ,
        # This checkout's interpreter, `p40fleet` and packages, whatever the venv was installed from.
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO_ROOT / "python"),
        "P40FLEET_STATE_DIR": str(tmp_path / "state"),
        "COLUMNS": "400",
    }
    for line in recipe():
        argv = [word.replace(f".sandbox/{DOC_NAME}/", f".sandbox/{name}/") for word in shlex.split(line, comments=True)]
        argv = [name if word == DOC_NAME and argv[i - 1] == "--name" else word for i, word in enumerate(argv)]
        done = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
        said = done.stdout + done.stderr
        assert done.returncode == 0, f"{line}: exit {done.returncode}\n{said[-4000:]}"
        for pattern in promised(argv):
            assert re.search(pattern, said), f"{line}: no {pattern!r} in\n{said[-4000:]}"
