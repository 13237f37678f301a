"""One host training alone, with the verl lock's real Ray (Ray 2.47.1 in the env site.yml built): `p40fleet train
start` runs the host's launch script, which starts the run's own Ray head on 127.0.0.1 and points verl's
`ray.init()` at it (docs/ray-single-host.md). The trainer is verl's `run_ppo` as far as Ray goes (RUN_PPO below:
its `ray.init()` and a TaskRunner actor, verl/trainer/main_ppo.py:35-50 of verl 0.4.1), then the stand-in trainer
(python/tests/fixtures/standins/trainer/verl_standin.py): verl itself cannot import without a real torch here. The
launch script is the one site.yml rendered, with that trainer in place of `-m verl.trainer.main_ppo` and nothing else
changed. While the run trains:
- from another sandbox host, every TCP port the owner's processes listen on refuses, on node1's IPv4 and IPv6
  addresses;
- from another local account on node1, the GCS and the dashboard agent's job API refuse (the owner gets through);
- a head that account started first (the default port, the shared /tmp/ray) is not joined;
and once `p40fleet train stop` ends the run, its Ray is gone.
Hosts: copies of conftest's site_image (site_fleet's node1 after its two runs, or built from a fresh host when the
module runs alone), under the stand-in service manager."""

from __future__ import annotations

import re
import time

import pytest

from p40fleet import train
from p40fleet.state import StateDir
from p40fleet_dev.paths import REPO_ROOT
from tests.ray_ports import LOOPBACK, connect, connect_all, ipv6_addresses, listening, swap_in_trainer

pytestmark = [pytest.mark.sandbox, pytest.mark.converge, pytest.mark.xdist_group("site-fleet")]

OWNER = "p40fleet"
INTRUDER = "intruder"
SCRIPT = f"/home/{OWNER}/train_gsm8k_ppo.sh"
STANDIN = REPO_ROOT / "python" / "tests" / "fixtures" / "standins" / "trainer" / "verl_standin.py"
STANDIN_DIR = "/opt/p40fleet-standin"
TRAINER = f"{STANDIN_DIR}/ray_trainer.py"
# verl 0.4.1's run_ppo as far as Ray goes (main_ppo.py:35-50): ray.init() where Ray is not initialized yet, with
# verl's runtime env and config.ray_init.num_cpus (null), then the trainer in a TaskRunner actor. Here the actor only
# reports where it runs and stays alive (its worker listens) while the stand-in prints verl's lines in the driver.
RUN_PPO = """
import os, sys
import ray
if not ray.is_initialized():
    ray.init(runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true", "NCCL_DEBUG": "WARN",
                                       "VLLM_LOGGING_LEVEL": "WARN", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}},
             num_cpus=None)

@ray.remote(num_cpus=1)
class TaskRunner:
    def where(self):
        return ray.get_runtime_context().gcs_address, os.getpid()

runner = TaskRunner.remote()
gcs, pid = ray.get(runner.where.remote())
print(f"ray-trainer: joined {gcs}, TaskRunner pid {pid}, nodes {len(ray.nodes())}", flush=True)
sys.path.insert(0, "/opt/p40fleet-standin")
import verl_standin
sys.exit(verl_standin.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def fleet(make_sandbox, site_image, tmp_path_factory):
    fleet = make_sandbox("lone-ray", ["p40", "p40"], services=True, image=site_image)
    fleet.state = StateDir(tmp_path_factory.mktemp("lone-ray-state"))
    fleet.train = lambda action, **kw: train.train(fleet.inventory_dir, action, state_dir=fleet.state, **kw)
    yield fleet
    fleet.down()


def test_a_lone_run_keeps_its_own_ray_to_root_and_the_owner(fleet):
    owner_uid = fleet.exec("node1", f"id -u {OWNER}").stdout.strip()
    # The trainer, root's; the launch script site.yml rendered, with it in place of verl's module and nothing else.
    files = {f"{STANDIN_DIR}/verl_standin.py": STANDIN.read_bytes(), TRAINER: RUN_PPO.encode()}
    assert swap_in_trainer(fleet, "node1", files, SCRIPT, TRAINER) == 3
    assert "--node-ip-address=127.0.0.1" in fleet.exec("node1", f"cat {SCRIPT}").stdout

    # Another account starts a head first: the default port and the shared, world-writable /tmp/ray.
    ray = fleet.exec("node1", f"sed -n 's/^readonly ENV_PREFIX=//p' {SCRIPT}").stdout.strip().strip("'") + "/bin/ray"
    made = fleet.exec("node1", f"useradd -m {INTRUDER}")
    assert made.returncode == 0, made.stderr
    theirs = fleet.exec(
        "node1", f"cd && {ray} start --head --disable-usage-stats --include-dashboard=false", user=INTRUDER
    )
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr

    overrides = ["trainer.total_training_steps=200", "+standin.step_seconds=2"]
    run = {"train_run_name": "lone", "train_run_overrides": overrides}
    started = fleet.train("start", extra_vars=run)
    assert started.run.rc == 0, started.run.failures
    log = f"/home/{OWNER}/.p40fleet/train/lone.log"
    deadline = time.monotonic() + 300
    while not re.search(r"^step:2 ", shown := fleet.exec("node1", f"cat {log}").stdout, re.MULTILINE):
        assert time.monotonic() < deadline, shown[-3000:]
        time.sleep(3)
    # verl's ray.init() joined the run's own head, alone in it, and not the other account's.
    joined = re.search(r"^ray-trainer: joined (\S+), TaskRunner pid \d+, nodes (\d+)$", shown, re.MULTILINE)
    assert joined and joined.groups() == ("127.0.0.1:6390", "1"), shown[-3000:]
    private = fleet.exec("node1", f"stat -c '%U %a' /home/{OWNER}/.p40fleet-ray-run").stdout.split()
    assert private == [OWNER, "700"]
    assert fleet.exec("node1", f"find /tmp/ray -user {OWNER} | head -1").stdout.strip() == ""

    # Every port the owner's processes listen on is on loopback, and refuses node2, over IPv4 and IPv6.
    ports = listening(fleet, "node1", owner_uid)
    assert {6390, 6391, 6392, 52366} <= {port for _, port in ports}, ports
    assert {address for address, _ in ports} <= LOOPBACK, ports
    v6 = ipv6_addresses(fleet, "node1")
    assert v6, "node1 has no IPv6 address on eth0 to knock on"
    targets = [
        (address, port)
        for port in sorted({port for _, port in ports})
        for address in [fleet.host("node1").address, *v6]
    ]
    knocks = connect_all(fleet, "node2", targets)
    assert set(knocks.values()) == {"refused"}, knocks
    # Another local account reaches neither the GCS nor the job API of the dashboard agent; the owner and root do.
    for port in (6390, 52366):
        assert connect(fleet, "node1", "127.0.0.1", port, user=INTRUDER) == "refused", port
        assert connect(fleet, "node1", "127.0.0.1", port, user=OWNER) == "connected", port
    assert connect(fleet, "node1", "127.0.0.1", 6390) == "connected"
    assert fleet.exec("node1", f"pgrep -u {INTRUDER} -x gcs_server").returncode == 0

    stopped = fleet.train("stop", extra_vars=run)
    assert stopped.run.rc == 0, stopped.run.failures
    # The run's Ray went with it; the other account's is left as it was.
    deadline = time.monotonic() + 60
    while fleet.exec("node1", f"pgrep -u {OWNER} -x 'raylet|gcs_server'").returncode == 0:
        assert time.monotonic() < deadline, fleet.exec("node1", f"ps -u {OWNER} -o pid,args").stdout
        time.sleep(2)
    assert fleet.exec("node1", f"pgrep -u {INTRUDER} -x gcs_server").returncode == 0
    assert fleet.exec("node1", "systemctl show -p ExecStart p40fleet-train-lone").returncode == 0
    assert "PrivateTmp=yes" in fleet.exec("node1", "cat /etc/systemd/system/p40fleet-train-lone.service").stdout
