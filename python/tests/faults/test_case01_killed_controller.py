"""Case 1: the controller SIGKILLed in the middle of the CUDA install, the conda env creation, the Apex build and
the verl install; the next run converges, and nothing half-installed counts as installed.

For each stage, node1 (converged) is put back to needing that stage's work, and site.yml is started as a process
of its own. host_trap.py, armed on node1, waits for the stage's long-running command, freezes its session and
steps it forward until part of the work is on disk (the toolkit's nvcc but no version.json; the env's python but
no conda-meta/history; Apex's build tree but no wheel; the first of verl's dependencies back, the rest not). Then
the controller's whole process group gets SIGKILL, and with it the SSH connections it held (its multiplexing
masters detach from the group, so they are killed by PID): a controller that dies takes its connections along.
The task's remote side dies with it (the trap SIGKILLs that session on the host); over SSH it could also run on
to its end, which leaves less half-done, so the harder case is the one tested.
Right after the kill, the role's own record of the stage says unfinished; the next run must do the stage's work
again and converge, and the one after it change nothing.
(test_cuda_toolkit.py kills the installer itself midway and has the next run redo it.)
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

import pytest
from tests.faults.tools import (
    CONVERGED_HOST,
    ENV,
    ENV_OWNER,
    ENV_PYTHON,
    SITE_PACKAGES,
    HostTrap,
    control_dir,
    env_packages,
    kill_controller,
    start_playbook,
)
from tests.pins import CUDA_HOME

pytestmark = [pytest.mark.sandbox, pytest.mark.fault_case(1), pytest.mark.faults_full]

HOST, OWNER, PYTHON = CONVERGED_HOST, ENV_OWNER, ENV_PYTHON
CUDA = CUDA_HOME
APEX_WHEELS = "/opt/p40fleet/apex-wheels"
# The throwaway build account's directory, where the build runs (roles/apex/tasks/build.yml).
APEX_BUILD = "/var/lib/p40fleet/apex-build"
VERL_MARKER = f"{ENV}/.p40fleet-verl-requirements.sha1"
CONDA_MARKER = "/var/lib/p40fleet/conda_env-verl-env.creating"


@dataclass(frozen=True)
class Stage:
    name: str
    undo: str  # root shell on the host: the stage's work undone, as if it never ran
    undo_as_owner: str  # the same, as the env's owner (pip in the env)
    pattern: str  # the stage's long-running command on the host
    until: str  # a glob: part of the work on disk
    unless: str  # a glob only a finished stage writes
    step: float  # seconds the frozen task runs per step
    unfinished: str  # root shell that must succeed right after the kill: the role's record says unfinished
    redone: str  # the task that must do the work again on the next run
    finished: str  # root shell that must succeed once the host converged again


STAGES = (
    Stage(
        "cuda_toolkit",
        f"rm -rf {CUDA}",
        "",
        r"cuda_11\.8\.0_520\.61\.05_linux\.run --silent",
        f"{CUDA}/bin/nvcc",
        f"{CUDA}/version.json",
        0.0002,
        f"test -e /var/lib/p40fleet/cuda_toolkit-cuda-11.8.installing && test ! -e {CUDA}/version.json",
        "Ensure the toolkit is installed by the runfile (silent, toolkit only)",
        f"test -e {CUDA}/version.json && test ! -e /var/lib/p40fleet/cuda_toolkit-cuda-11.8.installing",
    ),
    Stage(
        "conda_env",
        f"rm -rf {ENV}",
        "",
        r"conda create --yes --quiet --name verl-env",
        f"{ENV}/bin/python",
        f"{ENV}/conda-meta/history",
        0.002,
        f"test -e {CONDA_MARKER} && test ! -e {ENV}/conda-meta/history",
        "Ensure the env exists with the pinned Python, created by its owner",
        f"test -e {ENV}/conda-meta/history && test ! -e {CONDA_MARKER} && {PYTHON} -m pip --version",
    ),
    Stage(
        "apex",
        f"rm -f {ENV}/.p40fleet-apex.json && rm -rf {APEX_WHEELS} /var/lib/p40fleet/apex-wheels",
        f"{PYTHON} -m pip uninstall -y -q apex",
        r"pip wheel --no-build-isolation --no-deps",
        f"{APEX_BUILD}/apex/build/*/*",
        f"{APEX_BUILD}/wheels/apex-*.whl",
        0.002,
        f"test ! -e {ENV}/.p40fleet-apex.json",
        "Build the Apex wheel, asking for the extensions by command_line",
        f"test -e {ENV}/.p40fleet-apex.json",
    ),
    Stage(
        "verl",
        f"rm -f {VERL_MARKER}",
        f"{PYTHON} -m pip uninstall -y -q ray pyarrow transformers pandas",
        r"-m pip install --require-hashes",
        f"{SITE_PACKAGES}/ray/*",
        VERL_MARKER,
        0.002,
        f"test ! -e {VERL_MARKER}",
        "Ensure verl's dependencies are installed from the hash-pinned lock",
        f"test -e {VERL_MARKER}",
    ),
)


class NotConverged(AssertionError):
    """The run after the kill did not converge the host (the case's finding), as opposed to the case's own setup
    going wrong, which fails the case outright."""


def undo(fleet, stage: Stage) -> None:
    if stage.undo_as_owner:
        fleet.sh(HOST, stage.undo_as_owner, user=OWNER)
    fleet.sh(HOST, stage.undo)
    if stage.name == "apex":
        # The fleet's wheel of this key, on the controller: without it the host must build again.
        shutil.rmtree(fleet.sandbox.dir / "apex-wheels", ignore_errors=True)


def tasks_that_changed(result, host: str) -> set[str]:
    return {
        e["event_data"].get("task")
        for e in result.events
        if e.get("event") == "runner_on_ok"
        and e["event_data"].get("host") == host
        and e["event_data"].get("res", {}).get("changed")
    }


@pytest.mark.parametrize("stage", STAGES, ids=[s.name for s in STAGES])
def test_a_controller_killed_midway_leaves_nothing_counted_as_installed(converged_node1, stage, tmp_path):
    fleet = converged_node1
    undo(fleet, stage)
    trap = HostTrap(fleet.sandbox, HOST, f"case1-{stage.name}")
    log = tmp_path / "killed-run.log"
    trap.arm(pattern=stage.pattern, until=stage.until, unless=stage.unless, step=stage.step, action="freeze")
    cp = control_dir()
    run = start_playbook(fleet.inventory, fleet.password_file, HOST, log, cp)
    try:
        caught = trap.wait(run)
    finally:
        masters = kill_controller(run, cp) if run.poll() is None else []
        left = trap.kill()["left"] if trap.report() else None
    assert "error" not in caught and not caught["overshot"], caught  # caught midway, not after the end
    assert masters, "the killed run held no SSH connection of its own"
    assert left == []
    output = log.read_text()
    assert f"TASK [{stage.name} : " in output and "PLAY RECAP" not in output  # it died inside the stage

    # The role's own record: unfinished, whatever is on disk.
    assert fleet.exec(HOST, stage.unfinished).returncode == 0, stage.unfinished
    try:
        redone = fleet.converge(HOST)
    except AssertionError as error:
        # Leave node1 for the next case as a run from scratch of this stage makes it.
        undo(fleet, stage)
        fleet.converge(HOST)
        raise NotConverged(f"the run after the kill did not converge {HOST}: {error}") from error
    assert stage.redone in tasks_that_changed(redone, HOST)
    assert fleet.exec(HOST, stage.finished).returncode == 0, stage.finished
    assert env_packages(fleet.sandbox, HOST, PYTHON, OWNER)["broken"] == {}
