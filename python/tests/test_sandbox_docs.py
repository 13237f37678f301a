"""docs/dev/sandbox-day.md's operator's day for the env owner `trainer`, run as written: its commands are read from
the Markdown (the page's sh block) and run one by one from the checkout's root by `sh`, as an operator types them,
through this checkout's `python` and `p40fleet`. Only the sandbox's name is the test's own (`try` -> a pytest name,
so sessions side by side do not share a fleet); the state directory is a temporary one (P40FLEET_STATE_DIR). Each
command must exit with the code the page gives it (`# exits N: ...`, 0 where none; a row of docs/cli.md's table)
and say what the page promises: provisioned with nothing changed, no drift, a verdict per card, the report in text
and HTML, the run running, stopped, resumed; each bad input refused naming the host or the input, what was found
and what to do. Seen from the host: the run is `trainer`'s, and a refused start made nothing.

The hosts start from the converged image of that owner (P40FLEET_SANDBOX_IMAGE, the page's seam:
p40fleet_dev.images.owner_image, the one test_owner_fleet.py's fleet starts from, built once per suite run), so the
recipe's `p40fleet run` is a converged re-run there: test_owner_fleet.py proves the fresh converge for that owner.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable

import pytest

from p40fleet import cli
from p40fleet_dev import images, standins
from p40fleet_dev.cli import IMAGE_ENV
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import DEFAULT_OS, Sandbox, SandboxError
from tests import sandbox_removal
from tests.workers import sandbox_name

DOC = REPO_ROOT / "docs/dev/sandbox-day.md"
CLI_DOC = REPO_ROOT / "docs/cli.md"
DOC_NAME = "try"
OWNER = "trainer"
DEFAULT_OWNER = standins.DEFAULT_OWNER
PREFIX = "/opt/miniconda3"
LOG = f"/home/{OWNER}/.p40fleet/train/gsm8k.log"
# The owner image's unit (test_collection.py converges the host it is taken from).
pytestmark = pytest.mark.xdist_group("owner-image")
INVENTORY = r"\S+/inventory"


def unit_user(fleet: Sandbox) -> None:
    unit = fleet.exec("node1", "grep -x 'User=.*' /etc/systemd/system/p40fleet-train-gsm8k.service").stdout
    assert unit.split() == [f"User={OWNER}"], unit


def the_log_is_the_owners(fleet: Sandbox) -> None:
    assert fleet.exec("node1", f"stat -c %U {LOG}").stdout.strip() == OWNER
    assert fleet.exec("node1", f"grep -c '^step:' {LOG}").stdout.strip() != "0"


def nothing_made(fleet: Sandbox) -> None:
    assert fleet.exec("node1", "test -e /etc/systemd/system/p40fleet-train-other.service").returncode == 1
    assert fleet.exec("node1", f"getent passwd {DEFAULT_OWNER}").returncode == 2
    assert fleet.exec("node1", f"test -e /home/{DEFAULT_OWNER}").returncode == 1


# Each command of the page, in order: its words' start, its exit code, what it must say (a pattern; "!" before one:
# must not say), and what the host must show after it.
STEPS: list[tuple[str, int, list[str], Callable[[Sandbox], None] | None]] = [
    (
        "python -m p40fleet_dev sandbox up",
        0,
        [
            r"Hosts start from the converged image \S+ \(P40FLEET_SANDBOX_IMAGE\)",
            r"Stand-ins on every host \(test fixtures, not the real programs",
            r"systemctl +a stand-in service manager",
            r"trainer +a stand-in for verl's trainer",
            r"qualify +a stand-in nvidia-smi answering as recorded card p40-healthy",
            rf"env owner +the account {OWNER},",
            rf"Env owner {OWNER}: p40fleet_env_owner in \S+/inventory",
        ],
        None,
    ),
    ("p40fleet run", 0, [r"exit 0: ok", r"node1: \S+ ok=\d+ changed=0 failures=0 unreachable=0"], None),
    ("p40fleet report --refresh", 0, [r"p40fleet report: 1 host\(s\): 1 converged", r"!· drift: "], None),
    (
        "p40fleet qualify",
        0,
        [r"exit 0: ok", r"this run's verdicts and host failures are kept in .*gpu-qualify\.json"],
        None,
    ),
    ("p40fleet report", 0, [r"node1 GPU 0 serial \S+-node1 \(Tesla P40\): pass"], None),
    ("p40fleet report --html", 0, [r"p40fleet report: 1 host\(s\)"], None),
    ("p40fleet train start", 0, [r"node1 gsm8k: running"], unit_user),
    ("p40fleet train status", 0, [r"node1 gsm8k: running · step \d+ of 40", r"!resumed"], None),
    (
        "p40fleet train stop",
        0,
        [r"node1 gsm8k: stopped", r"node1: stopped by `p40fleet train stop`; `start` resumes it"],
        None,
    ),
    ("p40fleet train start", 0, [r"node1 gsm8k: running"], None),
    ("p40fleet train status", 0, [r"node1 gsm8k: running \(resumed\) · step \d+ of 40"], the_log_is_the_owners),
    (
        "p40fleet qualify",
        cli.EXIT_BAD_INPUT,
        [
            rf"the limit 'node9' matches no host of {INVENTORY}: name a host or group it has "
            rf"\(`ansible-inventory -i {INVENTORY} --graph` lists them\)"
        ],
        None,
    ),
    (
        "p40fleet run",
        cli.EXIT_BAD_INPUT,
        [
            r"-e launch_script_train_batch_sise: no role declares it \(roles/\*/meta/argument_specs.yml\), so no role "
            r"would read it: did you mean launch_script_train_batch_size"
        ],
        None,
    ),
    (
        "p40fleet run",
        cli.EXIT_BAD_INPUT,
        [
            r"-e launch_script_train_batch_size: found '-8'; expected an int of at least 1",
            r"must be at least 1 \(plugins/plugin_utils/verl_batches.py, BATCH_MINIMUMS\)",
        ],
        None,
    ),
    ("mkdir", 0, [], None),
    ("echo", 0, [], None),
    (
        "p40fleet train start",
        cli.EXIT_HOSTS_FAILED,
        [
            rf"node1: {PREFIX} was provisioned for the env owner '{OWNER}', but the env owner is now "
            rf"'{DEFAULT_OWNER}' \(p40fleet_env_owner\)\.",
            rf"Do: set p40fleet_env_owner back to '{OWNER}'",
        ],
        nothing_made,
    ),
    ("rm", 0, [], None),
    ("python -m p40fleet_dev sandbox down", 0, [r"Sandbox \S+ removed\."], None),
]


def recipe() -> list[str]:
    """The commands of the page's sh block, in order (each line as typed, its comment kept)."""
    [block] = re.findall(r"^```sh\n(.*?)^```", DOC.read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    return [line for line in block.splitlines() if shlex.split(line, comments=True)]


def documented_code(line: str) -> int:
    """The exit code the page gives a command: `# exits N: why`, 0 where it gives none."""
    found = re.search(r"#\s*exits (\d+): \S", line)
    return int(found.group(1)) if found else 0


def cli_codes() -> set[int]:
    """The exit codes of docs/cli.md's table."""
    return {int(code) for code in re.findall(r"^\| (\d+) \| ", CLI_DOC.read_text(encoding="utf-8"), re.MULTILINE)}


def test_the_recipe_is_every_step_the_test_checks():
    """Each command of the page has its step here, in order, with the exit code the page gives it, a code of
    docs/cli.md's table; the day is a non-default owner's (no container)."""
    lines = recipe()
    commands = [" ".join(shlex.split(line, comments=True)) for line in lines]
    assert len(commands) == len(STEPS), commands
    for command, line, (start, code, _, _) in zip(commands, lines, STEPS, strict=True):
        assert command.startswith(start + " "), (command, start)
        assert documented_code(line) == code, line
        assert code in cli_codes(), line
    assert f"--owner {OWNER}" in commands[0] and OWNER != DEFAULT_OWNER
    assert {cli.EXIT_BAD_INPUT, cli.EXIT_HOSTS_FAILED} <= {code for _, code, _, _ in STEPS}


def test_the_stand_ins_need_the_service_manager_and_a_recorded_card():
    """Refused before anything starts (no container): stand-ins without the service manager, an unknown card, an
    owner that is no account name."""
    with pytest.raises(SandboxError, match="need the stand-in service manager"):
        Sandbox("pytest-never-started").up(["p40"], standins=True)
    with pytest.raises(SandboxError, match="the env owner 'Bad Owner' is no account name"):
        Sandbox("pytest-never-started").up(["p40"], services=True, standins=True, owner="Bad Owner")
    with pytest.raises(ValueError, match="no recorded card 'p40-nothing'; recorded: p40-ecc-errors, "):
        standins.give_card(None, "node1", "p40-nothing")
    assert standins.DEFAULT_CARD in standins.card_names()


def test_both_owner_tests_start_from_one_image(monkeypatch):
    """test_owner_fleet's fleet and this day ask for the same converged variant, so the suite builds it once (the
    same key; images.converged_image builds a key's image under its lock only where it does not exist yet)."""
    from tests import test_owner_fleet

    asked = []
    monkeypatch.setattr(images, "converged_image", lambda **variant: asked.append(variant) or "image")
    assert images.owner_image(OWNER) == images.owner_image(test_owner_fleet.OWNER) == "image"
    assert asked[0] == asked[1] == {"profile": "p40", "login": "root", "extra_vars": {"p40fleet_env_owner": OWNER}}
    keys = {images.image_key(v["profile"], v["login"], DEFAULT_OS, None, v["extra_vars"]) for v in asked}
    assert len(keys) == 1


@pytest.mark.sandbox
def test_the_operators_day_runs_as_written(tmp_path):
    name = sandbox_name("docs")
    sandbox_removal.session.claim(name)
    fleet = Sandbox(name)
    sandbox_removal.session.keep_until_unit_ends(fleet)
    env = {
        **os.environ,
        # This checkout's interpreter, `p40fleet` and packages, whatever the venv was installed from.
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO_ROOT / "python"),
        "P40FLEET_STATE_DIR": str(tmp_path / "state"),
        "COLUMNS": "400",
        IMAGE_ENV: images.owner_image(OWNER),
    }
    html = REPO_ROOT / ".sandbox" / name / "report.html"
    for line, (_, code, patterns, host_check) in zip(recipe(), STEPS, strict=True):
        typed = line.replace(f".sandbox/{DOC_NAME}/", f".sandbox/{name}/").replace(
            f"--name {DOC_NAME} ", f"--name {name} "
        )
        typed = re.sub(rf"--name {DOC_NAME}$", f"--name {name}", typed)
        done = subprocess.run(
            ["sh", "-c", typed], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        said = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == code, f"{typed}: exit {done.returncode}, not {code}\n{said[-4000:]}"
        for pattern in patterns:
            if pattern.startswith("!"):
                assert not re.search(pattern[1:], said), f"{typed}: {pattern[1:]!r} in\n{said[-4000:]}"
            else:
                assert re.search(pattern, said), f"{typed}: no {pattern!r} in\n{said[-4000:]}"
        if "--html" in typed:
            page = html.read_text(encoding="utf-8")
            assert "node1" in page and "Tesla P40" in page, page[:2000]
        if host_check is not None:
            host_check(fleet)
