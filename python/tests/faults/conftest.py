"""The fault suite: one sandbox fleet shared by the cases. The markers, which cases run and the table of
cases printed at the end are tests/faults/table.py's, hooked in by python/tests/conftest.py (under pytest-xdist
the controller, which prints the table, loads only that conftest).
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from tests import sandbox_removal
from tests.faults.tools import CONDA_TMPFS, CONVERGED_HOST, ENV_OWNER, MODEL_REPO, MirrorServer, ProcessSampler
from tests.pins import STAGES as SITE_STAGES
from tests.workers import sandbox_name

from p40fleet import cli
from p40fleet.run import RunResult
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT
from p40fleet_dev.sandbox import Sandbox, podman, sandbox_disk_checks

# P40FLEET_FAULTS_KEEP=1 leaves the fleet running after the session (to iterate on one case); the next session
# reuses it when its hosts are the same, and every case puts the hosts it uses where it needs them.
SITE = REPO_ROOT / "site.yml"
# site.yml's stages (each tagged with its name), in order.
STAGES = ("gpu_preflight", *SITE_STAGES)

# -- the shared fleet ---------------------------------------------------------------------------------------


# The hosts that run the CUDA toolkit stage only for a case about its artifact or its installer (cases 2 and 3)
# leave out gcc-11/g++-11, an operator's documented choice: apt's unpack of a compiler is no part of those cases,
# and cost about 30 s a host (115 s of case 3's first run on four hosts). node1, test_cuda_toolkit.py and the
# site fleet install it.
NO_HOST_COMPILER = {"cuda_toolkit_host_compiler_install": False}

# host -> (GPU profile, small filesystems {path: size}, host_vars, what it is for). One sandbox serves every case:
# hosts a case breaks on purpose are its own, and node1 is the converged host cases take turns on, each leaving
# it converged again.
HOSTS: dict[str, tuple[str, dict[str, str], dict, str]] = {
    "node1": (
        "p40",
        {CONDA_TMPFS: "1200m"},
        # The env's own 1.2 GB filesystem, which case 12 fills: preflight's 20 GiB rule for it is waived here.
        {"gpu_preflight_disk_checks": sandbox_disk_checks(p40fleet_conda_prefix=0)},
        "converged by site.yml: cases 1, 7, 8, 10, 12 and test_privileges.py",
    ),
    "node2": ("p40-driver-too-old", {}, {}, "case 4: driver too old"),
    "node3": ("p40-driver-r590", {}, {}, "case 4: a branch past R580"),
    "node4": ("p40-upgraded-unloaded", {}, {}, "case 4: NVML mismatch after a driver upgrade"),
    "node5": ("nogpu", {}, {}, "case 4: no GPU"),
    "node6": (
        "p40",
        {"/srv/small": "64m"},
        # The runfile's real need for its extraction (the sandbox asks 1 GiB a path): the case is that figure.
        {
            "cuda_toolkit_tmpdir": "/srv/small/p40fleet",
            "gpu_preflight_disk_checks": sandbox_disk_checks(cuda_toolkit_tmpdir=10),
        },
        "case 6",
    ),
    "node7": ("p40", {}, NO_HOST_COMPILER, "case 2: tampered artifacts"),
    "node8": ("p40", {}, {}, "case 9: a wrong type"),
    "node9": ("p40", {}, {}, "case 9: a GPU model the host does not have"),
    "node10": ("p40", {}, {}, "case 9: a misspelt profile"),
    "node11": ("p40", {}, {}, "case 9: bad values met by later stages, strings from -e"),
    "node12": ("p40", {}, NO_HOST_COMPILER, "case 3: one of four hosts, converges"),
    "node13": ("p40", {}, NO_HOST_COMPILER, "case 3: one of four hosts, converges"),
    "node14": ("p40", {}, NO_HOST_COMPILER, "case 3: one of four hosts, converges"),
    "node15": ("p40", {}, NO_HOST_COMPILER, "case 3: the host that goes away mid-run and comes back"),
}


@dataclass
class Fleet:
    sandbox: Sandbox
    run: Callable[..., RunResult]
    # Hosts a case left in an unknown state (it failed midway): the next case that needs them converges them first.
    dirty: set[str] = field(default_factory=set)

    @property
    def inventory(self) -> Path:
        return self.sandbox.inventory_dir

    @property
    def password_file(self) -> Path:
        return self.sandbox.become_password_file

    def play(self, limit: str, stages: tuple[str, ...] = (), upto: str = "", **kwargs) -> RunResult:
        """site.yml against `limit`, with the sandbox's sudo password as a file. `stages` runs only those (and
        preflight) by their tags; `upto` runs every stage up to that one, untagged (`--tags host_prereqs` runs
        that role's verify-only assert against the probe taken before the install). Either way the stages after
        the last skip whole, their `always` tasks too: they would probe what a host that never got that far
        cannot have."""
        last = max((STAGES.index(stage) for stage in (*stages, upto) if stage), default=len(STAGES) - 1)
        if stages:
            kwargs["tags"] = ",".join(("gpu_preflight", *stages))
        if last < len(STAGES) - 1:
            kwargs["skip_tags"] = ",".join(STAGES[last + 1 :])
        return self.run(SITE, self.inventory, limit=limit, become_password_file=self.password_file, **kwargs)

    def converge(self, host: str) -> RunResult:
        """Run site.yml on the host until it reports success, then once more: that one must change nothing."""
        result = self.play(host)
        assert result.rc == 0, [f"{f.task}: {f.message}" for f in result.failures]
        again = self.play(host)
        assert again.rc == 0 and again.stats[host]["changed"] == 0, again.stdout[-4000:]
        self.dirty.discard(host)
        return result

    def exec(self, host: str, command: str, user: str = "root"):
        return self.sandbox.exec(host, command, user=user)

    def sh(self, host: str, command: str, user: str = "root") -> str:
        result = self.sandbox.exec(host, command, user=user)
        assert result.returncode == 0, f"{host}: {command}: {result.stderr}"
        return result.stdout.strip()

    def exists(self, host: str, path: str) -> bool:
        return self.sandbox.exec(host, f"test -e {path} || test -L {path}").returncode == 0

    def host_vars(self, host: str, **values) -> None:
        """Set (or, with None, drop) inventory variables of one host, as a user edits host_vars."""
        path = self.inventory / "host_vars" / f"{host}.yml"
        current = yaml.safe_load(path.read_text()) if path.exists() else {}
        for key, value in values.items():
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
        path.parent.mkdir(exist_ok=True)
        path.write_text("---\n" + yaml.safe_dump(current, sort_keys=True))


@pytest.fixture(scope="session")
def fleet(run_playbook):
    sandbox = Sandbox(sandbox_name("faults"))
    sandbox_removal.session.claim(sandbox.name)
    sandbox.up(
        [profile for profile, _, _, _ in HOSTS.values()],
        login="sudo-password",
        tmpfs={host: mounts for host, (_, mounts, _, _) in HOSTS.items() if mounts},
    )
    if os.environ.get("P40FLEET_FAULTS_KEEP") == "1":
        sandbox.kept_file.touch()  # the next session's start leaves it to be reused
    else:
        sandbox.kept_file.unlink(missing_ok=True)
        sandbox_removal.session.keep_until_unit_ends(sandbox)
    shared = Fleet(sandbox, run_playbook)
    for host, (_, _, host_vars, _) in HOSTS.items():
        # A sandbox kept from an interrupted session may carry a case's leftovers: every host starts as set here.
        (shared.inventory / "host_vars" / f"{host}.yml").unlink(missing_ok=True)
        if host_vars:
            shared.host_vars(host, **host_vars)
    # node1's env filesystem is a root-owned mount point, and root hands the owner only a directory it made itself
    # (docs/privileges.md): the host is prepared as an operator with a filesystem of its own for the prefix would do
    # it, the env owner made first (as conda_env makes it) and the mount point given to it.
    shared.sh(
        CONVERGED_HOST,
        f"id -u {ENV_OWNER} >/dev/null 2>&1 || useradd --system --create-home --shell /bin/bash {ENV_OWNER};"
        f" chown {ENV_OWNER}: {CONDA_TMPFS} && chmod 0755 {CONDA_TMPFS}",
    )
    return shared


HUB_PORT = 8092


@dataclass
class FirstConverge:
    """node1's first converge, run as a user runs it: `p40fleet run --report` with a sudo password file and a
    Hub token in host_vars, every process list sampled throughout (case 10 reads all of it)."""

    code: int
    console: str
    report_path: Path
    run_dirs: list[Path]
    sampler: ProcessSampler
    token: str
    password: str
    hub: MirrorServer


@pytest.fixture(scope="session")
def first_converge(fleet, tmp_path_factory) -> FirstConverge:
    # A Hub of our own in the mirror container: the sandbox's model copied, gated by a token made for this run
    # (written through stdin, so no argument list ever holds it).
    token = "hf_" + secrets.token_hex(20)
    hub = MirrorServer(fleet.sandbox, HUB_PORT, "hub", hub=True)
    hub.exec(f"rm -rf {hub.root} && mkdir -p {hub.root} && cp -a /srv/mirror/hub {hub.root}/hub")
    gate = f"{hub.root}/hub/models/{MODEL_REPO}/.gated-token"
    podman("exec", "-i", hub.container, "sh", "-c", f"cat > {gate}", input_bytes=token.encode())
    hub.start()
    fleet.host_vars("node1", training_data_hub_token=token, training_data_hub_endpoint=hub.url)
    # On a fleet kept from an earlier session the model is there already: the token must be used all the same.
    fleet.sh("node1", "rm -rf /opt/p40fleet/models")
    password = fleet.password_file.read_text().strip()
    report = tmp_path_factory.mktemp("first-converge") / "report.json"
    # Each run's private dir (artifacts, the command, job events) is under p40fleet's state directory, in this
    # inventory's own directory: other workers' runs, still writing their events, are in other inventories' dirs.
    runs = StateDir().inventory(fleet.inventory).runs_dir
    before = set(runs.glob("*"))
    sampler = ProcessSampler([token.encode(), password.encode()], [fleet.sandbox.host("node1").container])
    sampler.start()
    console = io.StringIO()
    try:
        with contextlib.redirect_stderr(console), contextlib.redirect_stdout(console):
            code = cli.main(
                [
                    "run",
                    "-i",
                    str(fleet.inventory),
                    "-l",
                    "node1",
                    "--report",
                    str(report),
                    "--become-password-file",
                    str(fleet.password_file),
                ]
            )
    finally:
        sampler.stop()
    if code == cli.EXIT_OK:
        fleet.dirty.discard("node1")
    else:
        fleet.dirty.add("node1")
    # Copied as the run left them: p40fleet keeps the newest runs per inventory only (--keep-runs), and the cases
    # that run before case 10's tests would rotate these away.
    kept = tmp_path_factory.mktemp("first-converge-runs")
    run_dirs = []
    for path in sorted(set(runs.glob("*")) - before):
        run_dirs.append(kept / path.parent.parent.name / path.name)
        shutil.copytree(path, run_dirs[-1], symlinks=True)
    return FirstConverge(code, console.getvalue(), report, run_dirs, sampler, token, password, hub)


def take_node1(fleet: Fleet, first_converge: FirstConverge) -> Fleet:
    """node1 converged (again, where the case before left it otherwise), and counted dirty from now on: a case that
    leaves it converged calls fleet.converge("node1") at its end; if it failed before that, the next case that
    needs node1 converges it first."""
    assert first_converge.code == cli.EXIT_OK, first_converge.console[-4000:]
    if "node1" in fleet.dirty:
        fleet.converge("node1")
    fleet.dirty.add("node1")
    return fleet


@pytest.fixture
def converged_node1(fleet, first_converge) -> Fleet:
    """node1 converged for one test (take_node1)."""
    return take_node1(fleet, first_converge)


@pytest.fixture(scope="module")
def module_node1(fleet, first_converge) -> Fleet:
    """node1 converged for the tests of one module (take_node1), which together leave it as converged_node1's
    test would."""
    return take_node1(fleet, first_converge)
