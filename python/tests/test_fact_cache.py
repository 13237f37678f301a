"""A changed inventory takes effect on the next run, with fact caching on (ansible.cfg: jsonfile).

A cacheable set_fact outranks inventory variables for the cache's lifetime (a day): a role that
cached its own input (cuda_toolkit_home) kept installing to the old path after the inventory moved it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from p40fleet.paths import ANSIBLE_CONFIG
from p40fleet_dev.paths import REPO_ROOT
from tests.host_state import exists, sh
from tests.pins import CUDA_HOME

pytestmark = pytest.mark.sandbox

HOST = "node1"
FIRST_HOME = CUDA_HOME
MOVED_HOME = "/opt/cuda-11.8-moved"
WITNESS_PLAY = """---
- name: Cache a witness fact
  hosts: p40-hosts
  gather_facts: false
  tags: [always]
  tasks:
    - name: Cache the witness
      ansible.builtin.set_fact:
        fact_cache_witness: "{{ witness }}"
        cacheable: true
"""


def cached_facts(fact_cache) -> dict:
    # ansible-core 2.19's jsonfile cache names the file "<serialization>_<host>" (e.g. s1_node1) and
    # wraps the facts in a payload of tagged values.
    (path,) = [p for p in fact_cache.iterdir() if p.name == HOST or p.name.endswith("_" + HOST)]
    data = json.loads(path.read_text())
    facts = json.loads(data["__payload__"]) if "__payload__" in data else data
    return {k: v["value"] if isinstance(v, dict) and "value" in v else v for k, v in facts.items()}


@pytest.fixture(scope="module")
def cuda_play(make_sandbox, tmp_path_factory):
    sandbox = make_sandbox("fact-cache", ["p40"])
    reset = sandbox.exec(
        HOST, f"rm -rf /usr/local/cuda /usr/local/cuda-* {MOVED_HOME} /etc/p40fleet /var/lib/p40fleet /var/tmp/p40fleet"
    )
    assert reset.returncode == 0, reset.stderr
    play_dir = tmp_path_factory.mktemp("fact-cache")
    fact_cache = play_dir / "fact_cache"
    # The CUDA playbook beside its own host_vars (inventory-level variables, which a cached fact
    # outranks), after a play that caches one witness fact: proof that these runs cache facts.
    cuda_plays = (REPO_ROOT / "python" / "tests" / "playbooks" / "cuda_cudnn.yml").read_text().removeprefix("---\n")
    (play_dir / "cuda.yml").write_text(WITNESS_PLAY + cuda_plays)
    (play_dir / "host_vars").mkdir()
    controller_cache = tmp_path_factory.mktemp("controller-cache")

    def run(host_vars: dict, witness: str) -> subprocess.CompletedProcess:
        (play_dir / "host_vars" / f"{HOST}.yml").write_text("---\n" + yaml.safe_dump(host_vars))
        # Plain ansible-playbook, as a user runs it: ansible-runner keeps a fact cache per run only.
        done = subprocess.run(
            [
                str(Path(sys.executable).parent / "ansible-playbook"),
                "-i",
                str(sandbox.inventory_dir),
                "--tags",
                "cuda_toolkit",
                "-e",
                json.dumps({"artifact_fetch_controller_cache_dir": str(controller_cache), "witness": witness}),
                str(play_dir / "cuda.yml"),
            ],
            capture_output=True,
            text=True,
            check=False,
            env={
                **os.environ,
                "ANSIBLE_CONFIG": str(ANSIBLE_CONFIG),
                "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(fact_cache),
                "ANSIBLE_FORCE_COLOR": "0",
            },
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    return sandbox, fact_cache, run


def test_a_changed_cuda_toolkit_home_takes_effect_on_the_next_run(cuda_play):
    sandbox, fact_cache, run = cuda_play
    run({"cuda_toolkit_home": FIRST_HOME}, witness="first")
    assert exists(sandbox, HOST, f"{FIRST_HOME}/version.json")
    assert cached_facts(fact_cache)["fact_cache_witness"] == "first"

    moved = run({"cuda_toolkit_home": MOVED_HOME}, witness="second")
    assert cached_facts(fact_cache)["fact_cache_witness"] == "second"
    assert int(re.search(rf"^{HOST}\s+: ok=\d+\s+changed=(\d+)", moved.stdout, re.MULTILINE)[1]) > 0
    assert '"version" : "11.8.' in sh(sandbox, HOST, f"cat {MOVED_HOME}/version.json")
    assert f"export CUDA_HOME={MOVED_HOME}\n" in sh(sandbox, HOST, "cat /etc/p40fleet/cuda-11.8.sh")
