"""The stand-ins that let `p40fleet qualify` and `p40fleet train` run on sandbox hosts, which have no GPU and no verl.

`sandbox up --services` (Sandbox.up(standins=True)) puts them on every host; the qualification and training tests
put the same ones there themselves (test_gpu_qualify.py, test_train_runs.py). All are test fixtures under
python/tests/fixtures/standins/, each file's header saying what real behaviour it reproduces and from what:
- the service manager (host/systemd/): `systemctl` for train_run's units (Sandbox.up(services=True));
- verl's trainer (trainer/verl_standin.py): verl's metric lines and checkpoints, no GPU; train_run_command runs it;
- root's nvidia-smi during a qualification (gpu_qualify/nvidia-smi), answering from one recorded card (the YAML
  beside it), with that card's recorded kernel log; the load sleeps as the env owner (nothing it prints is read).
Each is root's, under root-owned directories, as the real programs are: the env owner can write none of them.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from types import ModuleType
from typing import Any, Protocol

import yaml

from p40fleet_dev.paths import REPO_ROOT, STANDINS_DIR

QUALIFY_STANDINS = STANDINS_DIR / "gpu_qualify"
TRAINER = STANDINS_DIR / "trainer" / "verl_standin.py"
TRAINER_ON_HOST = "/usr/local/libexec/p40fleet-standin/verl_standin.py"
QUALIFY_SMI = "/usr/local/lib/p40fleet-sandbox/nvidia-smi"
QUALIFY_SCENARIO = "/etc/p40fleet-sandbox/qualify.json"
KERNEL_LOG = "/etc/p40fleet-sandbox/kernel.log"
# The card every host of `sandbox up --services` qualifies (any recorded card's name: python -m p40fleet_dev sandbox
# qualify-card HOST CARD gives a host another).
DEFAULT_CARD = "p40-healthy"
# One card per host: nvidia-smi topo's one-row matrices, as a single-GPU host's driver answers them.
SINGLE_CARD_TOPO = "\tGPU0\n GPU0\tX\n\nLegend:\n\n  X    = Self\n"
# The load's stand-in: the env owner's process for the role's seconds (its last argument); it loads nothing.
QUALIFY_LOAD = "import sys, time; time.sleep(float(sys.argv[-1]))"
# The env owner `sandbox up --services` makes (roles/p40fleet_defaults' default), as conda_env would make it.
DEFAULT_OWNER = yaml.safe_load((REPO_ROOT / "roles" / "p40fleet_defaults" / "defaults" / "main.yml").read_text())[
    "p40fleet_env_owner"
]

# What `sandbox up --services` adds to the sandbox group's variables: train_run's and gpu_qualify's commands pointed
# at the stand-ins. A short run (40 steps of 3 s, a checkpoint every 5) and a short qualification (5 s).
OPERATOR_VARS: dict[str, Any] = {
    "train_run_command": [
        "/usr/bin/python3",
        TRAINER_ON_HOST,
        "trainer.total_training_steps=40",
        "trainer.save_freq=5",
        "trainer.test_freq=5",
        "+standin.step_seconds=3",
    ],
    "gpu_qualify_nvidia_smi": QUALIFY_SMI,
    "gpu_qualify_kernel_log_command": ["/bin/cat", KERNEL_LOG],
    "gpu_qualify_load_command": ["/usr/bin/python3", "-I", "-c", QUALIFY_LOAD],
    "gpu_qualify_seconds": 5,
    "gpu_qualify_sample_interval": 1,
}


class Fleet(Protocol):
    """What these helpers need of a p40fleet_dev.sandbox.Sandbox."""

    def put_file(self, host: str, path: str, data: bytes, mode: str) -> None: ...

    def exec(self, host: str, command: str, user: str = "root") -> Any: ...


@cache
def qualify_rules() -> ModuleType:
    """roles/gpu_qualify's filter (plugins/filter/gpu_qualify.py): the sample fields each driver is asked for."""
    spec = importlib.util.spec_from_file_location(
        "gpu_qualify_rules", REPO_ROOT / "plugins" / "filter" / "gpu_qualify.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def card_names() -> list[str]:
    return sorted(p.stem for p in QUALIFY_STANDINS.glob("p40-*.yml"))


def give_card(
    fleet: Fleet, host: str, name: str, edit: tuple[str, str] | None = None, own_serial: bool = False
) -> dict:
    """Make a host's qualification stand-in answer as the recorded card `name` (gpu_qualify/<name>.yml); `edit`
    replaces one text of its `nvidia-smi -q` report; `own_serial` makes its serial number the host's own (hosts
    given the same card are then different cards, as on a real fleet)."""
    if name not in card_names():
        raise ValueError(f"no recorded card {name!r}; recorded: {', '.join(card_names())}")
    case = yaml.safe_load((QUALIFY_STANDINS / f"{name}.yml").read_text())
    if edit:
        if edit[0] not in case["smi_q"]:
            raise ValueError(f"card {name}: {edit[0]!r} is not in its nvidia-smi -q report")
        case["smi_q"] = case["smi_q"].replace(*edit)
    if own_serial:
        serial = re.search(r"Serial Number\s+: (\S+)", case["smi_q"]).group(1)
        case["smi_q"] = case["smi_q"].replace(serial, f"{serial}-{host}")
        case["samples"] = case["samples"].replace(serial, f"{serial}-{host}")
    fields = qualify_rules().sample_fields(case["reasons_prefix"])
    scenario = {
        **case,
        "samples_fields": fields,
        "cards": 1,
        "topo_m": SINGLE_CARD_TOPO,
        "topo_p2p_r": SINGLE_CARD_TOPO,
    }
    fleet.put_file(host, QUALIFY_SCENARIO, json.dumps(scenario).encode(), "0644")
    fleet.put_file(host, KERNEL_LOG, case["kernel_log"].encode(), "0600")
    return case


def install_qualify(fleet: Fleet, host: str) -> None:
    """Root's stand-in nvidia-smi for the qualification (the card: give_card)."""
    fleet.put_file(host, QUALIFY_SMI, (QUALIFY_STANDINS / "nvidia-smi").read_bytes(), "0755")


def install_trainer(fleet: Fleet, host: str) -> None:
    """verl's trainer stand-in at TRAINER_ON_HOST, root's (train_run_command runs it as the env owner)."""
    fleet.put_file(host, TRAINER_ON_HOST, TRAINER.read_bytes(), "0755")


def make_owner(fleet: Fleet, host: str, owner: str = DEFAULT_OWNER) -> None:
    """The env owner's account, as roles/conda_env makes it (a system account with a home and bash), unless it is
    there: qualify and train run as it, and a sandbox host has no conda env."""
    made = fleet.exec(host, f"id {owner} >/dev/null 2>&1 || useradd --system --create-home --shell /bin/bash {owner}")
    if made.returncode != 0:
        raise RuntimeError(f"{host}: making the env owner {owner} failed: {made.stderr.strip()}")


def install_operator_standins(fleet: Fleet, host: str, owner: str = DEFAULT_OWNER) -> None:
    """Everything `sandbox up --services` puts on one host: the owner (`owner`, where the host has no such account
    yet), the trainer and the qualification's nvidia-smi with the default card, its serial the host's own."""
    make_owner(fleet, host, owner)
    install_trainer(fleet, host)
    install_qualify(fleet, host)
    give_card(fleet, host, DEFAULT_CARD, own_serial=True)
