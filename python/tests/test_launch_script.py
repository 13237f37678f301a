"""launch_script: render the script for several GPU profiles and compose its overrides with hydra-core
against the real Hydra configs of verl 0.4.1 and 0.5.0, taken from their PyPI wheels (upstream.txt).

No containers: the role runs with ansible-playbook over a local connection, the rendered script's
--print gives the overrides, and the role's own compose helper (the one --dry-run runs) checks them.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from p40fleet.fleet import smoke_results
from p40fleet_dev.paths import REPO_ROOT, UPSTREAM_DIR
from tests.launch_render import parse_printed, preflight_profile, render
from tests.local_hosts import ROOT_PLAYS_OWNER
from tests.pins import CUDA_HOME

ROLE = REPO_ROOT / "roles" / "launch_script"
PLAYBOOK = REPO_ROOT / "python" / "tests" / "playbooks" / "launch_script.yml"
COMPOSE = ROLE / "files" / "launch_script_compose.py"
VERSIONS = ("0.4.1", "0.5.0")
# A secret with the characters a naive `export NAME=value` gets wrong.
SECRET = "wandb-s3cr3t 'quoted' $HOME;`id`"

HOSTS = {
    "p40": preflight_profile("Tesla P40", "6.1", 24576, 1),
    "p40x2": preflight_profile("Tesla P40", "6.1", 24576, 2),
    "v100": preflight_profile("Tesla V100-SXM2-32GB", "7.0", 32768, 1),
    "a100": preflight_profile("NVIDIA A100-SXM4-40GB", "8.0", 40960, 1),
}


@pytest.fixture(scope="module")
def verl_configs(tmp_path_factory) -> dict[str, Path]:
    """verl/trainer/config of each release, unpacked from its PyPI wheel."""
    out = tmp_path_factory.mktemp("verl-wheels")
    dirs = {}
    for version in VERSIONS:
        wheels = sorted((UPSTREAM_DIR / "wheel").glob(f"verl-{version}-*.whl"))
        if not wheels:
            pytest.fail(f"no verl {version} wheel in {UPSTREAM_DIR / 'wheel'}: run `make fixtures` (upstream.txt)")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.startswith("verl/trainer/config/")]
            wheel.extractall(out / version, members)
        dirs[version] = out / version / "verl" / "trainer" / "config"
    return dirs


@pytest.fixture(scope="module")
def sdists(tmp_path_factory) -> dict[str, Path]:
    """The verl sources (PyPI sdists), to read the lines that consume the keys the script adds."""
    out = tmp_path_factory.mktemp("verl-sdists")
    roots = {}
    for version in VERSIONS:
        with tarfile.open(UPSTREAM_DIR / "sdist" / f"verl-{version}.tar.gz") as sdist:
            sdist.extractall(out, filter="data")
        roots[version] = out / f"verl-{version}"
    return roots


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, dict]:
    """Run the role once for every host of HOSTS (twice: the second changes nothing);
    {host: {"script": path, "printed": text, "overrides": [...]}}."""
    hosts = {name: {"profile": profile} for name, profile in HOSTS.items()}
    # vLLM is not installed by p40fleet (the verl role refuses it): a fleet that installs its own says so.
    hosts["v100"]["launch_script_vllm_installed"] = True
    hosts["p40"]["launch_script_environment"] = {"WANDB_API_KEY": SECRET, "WANDB_MODE": "offline"}
    hosts["p40x2"]["launch_script_extra_overrides"] = ["trainer.val_before_train=False"]
    hosts["p40x2"]["launch_script_host_overrides"] = ["trainer.total_epochs=2"]
    out, _ = render(hosts, tmp_path_factory.mktemp("launch-script"), idempotent=True)
    result = {}
    for name, item in out.items():
        assert not item.refused, (name, item.refused)
        shown = subprocess.run([str(item.script), "--print"], capture_output=True, text=True, check=True).stdout
        result[name] = {
            "script": item.script,
            "printed": shown,
            "overrides": item.overrides,
            "smoke": item.smoke_overrides,
        }
    return result


def as_dict(overrides: list[str]) -> dict[str, str]:
    result = {}
    for override in overrides:
        key, _, value = override.partition("=")
        result[key.lstrip("+")] = value
    return result


def added_keys() -> list[dict]:
    return yaml.safe_load((ROLE / "vars" / "main.yml").read_text())["launch_script_added_keys"]


def compose(config_dir: Path, overrides: list[str], keys: list[str]) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(COMPOSE), "--config-dir", str(config_dir)]
    for key in keys:
        argv += ["--added-key", key]
    return subprocess.run([*argv, "--", *overrides], capture_output=True, text=True, check=False)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("host", list(HOSTS))
def test_every_override_composes_against_verls_own_config(rendered, verl_configs, version, host):
    overrides = rendered[host]["overrides"]
    done = compose(verl_configs[version], overrides, [k["key"] for k in added_keys()])
    assert done.returncode == 0, done.stderr
    composed = yaml.safe_load(done.stdout)
    values = as_dict(overrides)
    assert composed["trainer"]["n_gpus_per_node"] == int(values["trainer.n_gpus_per_node"])
    fsdp = composed["actor_rollout_ref"]["actor"]["fsdp_config"]
    wanted = values["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"]
    assert fsdp["mixed_precision"]["param_dtype"] == wanted
    assert composed["critic"]["model"]["fsdp_config"]["model_dtype"] == "fp32"


@pytest.mark.parametrize("version", VERSIONS)
def test_created_keys_are_only_those_verl_reads_with_get(rendered, verl_configs, version):
    """Every `+key` of the script is one of the named keys; without that list the compose refuses them."""
    overrides = rendered["p40"]["overrides"]
    created = sorted({o.split("=", 1)[0].lstrip("+") for o in overrides if o.startswith("+")})
    assert created == sorted(k["key"] for k in added_keys())
    refused = compose(verl_configs[version], overrides, [])
    assert refused.returncode == 1
    for key in created:
        assert f"has no {key}," in refused.stderr


@pytest.mark.parametrize("version", VERSIONS)
def test_each_named_created_key_is_read_with_get_at_the_cited_line(sdists, version):
    for entry in added_keys():
        path, line = entry["reads"][version].split(":")
        text = (sdists[version] / path).read_text().splitlines()[int(line) - 1]
        leaf = entry["key"].split(".")[-1]
        parent = entry["key"].split(".")[-2]
        # model_dtype is read as fsdp_config.get("model_dtype"); the precision keys as
        # mixed_precision_config.get("param_dtype"), whose node is itself read with .get("mixed_precision").
        assert f'.get("{leaf}"' in text, f"{version} {path}:{line} does not read {leaf}: {text!r}"
        if parent == "mixed_precision":
            block = (sdists[version] / path).read_text().splitlines()[int(line) - 6 : int(line)]
            assert any('.get("mixed_precision"' in b for b in block), (version, path, line)


@pytest.mark.parametrize("version", VERSIONS)
def test_dead_keys_of_the_seed_recipe_are_refused(verl_configs, version):
    done = compose(
        verl_configs[version],
        ["++actor_rollout_ref.fsdp_config.cpu_offload=true", "actor_rollout_ref.actor.no_such_key=1"],
        [k["key"] for k in added_keys()],
    )
    assert done.returncode == 1
    assert "actor_rollout_ref.fsdp_config.cpu_offload" in done.stderr
    assert "no_such_key" in done.stderr


def test_settings_follow_each_profile(rendered):
    p40, p40x2, v100, a100 = (as_dict(rendered[h]["overrides"]) for h in ("p40", "p40x2", "v100", "a100"))
    assert p40["trainer.n_gpus_per_node"] == "1" and p40x2["trainer.n_gpus_per_node"] == "2"
    # The hf rollout generates with the actor as it is: its parameters stay on the GPU (an offloaded actor stopped
    # step 1 on a GPU). The critic's stay on the GPU too: they fit one P40 (docs/gpu-runs/sweep/p40-1x.json).
    assert p40["actor_rollout_ref.actor.fsdp_config.param_offload"] == "False"
    assert p40["critic.model.fsdp_config.param_offload"] == "False"
    assert p40x2["actor_rollout_ref.actor.fsdp_config.param_offload"] == "False"
    assert p40x2["critic.model.fsdp_config.param_offload"] == "False"
    for pascal in (p40, p40x2):
        assert pascal["actor_rollout_ref.rollout.name"] == "hf"
        assert pascal["actor_rollout_ref.rollout.micro_batch_size"] == "256"
        # No GSM8K prompt is over 256 tokens (docs/gpu-runs/sweep/gsm8k-prompt-lengths.json): none is dropped.
        assert pascal["data.max_prompt_length"] == "256" and pascal["data.filter_overlong_prompts"] == "True"
        assert pascal["actor_rollout_ref.rollout.tensor_model_parallel_size"] == "1"
        # HFRollout reads neither: not rendered.
        assert "actor_rollout_ref.rollout.dtype" not in pascal
        assert "actor_rollout_ref.rollout.gpu_memory_utilization" not in pascal
        assert pascal["actor_rollout_ref.actor.use_torch_compile"] == "False"
        assert pascal["actor_rollout_ref.model.use_remove_padding"] == "False"
        assert pascal["critic.model.use_remove_padding"] == "False"
    for host in rendered:
        keys = as_dict(rendered[host]["overrides"])
        # No reference model without a KL term, no reward model: their keys would do nothing.
        assert not [k for k in keys if k.startswith(("actor_rollout_ref.ref.", "reward_model."))], host
    # Volta: fp16 rollout, but fp32 parameters (no loss scaler in verl 0.4.1/0.5.0); vLLM reads its own keys.
    assert v100["actor_rollout_ref.rollout.dtype"] == "float16"
    assert v100["actor_rollout_ref.rollout.gpu_memory_utilization"] == "0.5"
    assert "actor_rollout_ref.rollout.micro_batch_size" not in v100
    assert v100["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert v100["critic.model.fsdp_config.mixed_precision.param_dtype"] == "fp32"
    assert v100["actor_rollout_ref.rollout.name"] == "vllm"
    # Without vLLM in the env every profile generates with hf.
    assert a100["actor_rollout_ref.rollout.name"] == "hf" and "actor_rollout_ref.rollout.dtype" not in a100
    assert a100["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "bf16"
    # p40fleet's flash_attn is a shim (no FlashAttention-2 for CUDA 11.8): no packed-sequence path on any profile.
    assert a100["actor_rollout_ref.model.use_remove_padding"] == "False"
    assert a100["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "8"
    assert p40["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] == "8"
    # Extra overrides from group and host come last, in that order.
    assert rendered["p40x2"]["overrides"][-2:] == ["trainer.val_before_train=False", "trainer.total_epochs=2"]


def test_validation_batches_split_and_checkpoints_are_kept_by_default(rendered):
    p40, p40x2, v100 = (as_dict(rendered[h]["overrides"]) for h in ("p40", "p40x2", "v100"))
    # One hf generate call per rank (test_cpu_verl.py runs verl's chunking over it for 1 to 8 GPUs).
    assert p40["data.val_batch_size"] == "256" and p40x2["data.val_batch_size"] == "512"
    for keys in (p40, p40x2, v100):
        # One checkpoint and one validation an epoch: GSM8K's 7473 train rows in batches of 256 (verl drops the
        # partial one).
        assert keys["trainer.save_freq"] == "29" and keys["trainer.test_freq"] == "29"
        assert keys["trainer.max_actor_ckpt_to_keep"] == "2" and keys["trainer.max_critic_ckpt_to_keep"] == "2"
        name = keys["trainer.experiment_name"]
        assert re.fullmatch(r"[a-z0-9]+-ppo-[0-9a-f]{8}", name), name
        assert keys["trainer.default_local_dir"] == f"/srv/verl-runs/checkpoints/{name}"


def test_print_states_the_schedule_and_an_estimate_on_stderr_and_only_the_command_on_stdout(rendered):
    """The overrides the GPU records digest are --print's stdout (tests/launch_render.py): the schedule and the
    estimate (docs/estimate.md) go to stderr, for a plain --print only."""
    script = rendered["p40"]["script"]
    done = subprocess.run([str(script), "--print"], capture_output=True, text=True, check=True)
    assert done.stdout == rendered["p40"]["printed"] and parse_printed(done.stdout) == rendered["p40"]["overrides"]
    lines = done.stderr.splitlines()
    assert lines[0].startswith("schedule: 435 steps (15 epochs of 7473 rows at 256), 16 validations of 1319 rows")
    assert "15 saved, the last 2 kept (11.0 GiB each, 22.1 GiB on disk)" in lines[0]
    assert re.match(r"estimate for 1x Tesla P40, .* [0-9.]+ minutes a step \(gen [0-9]+ s, ", lines[1]), lines[1]
    assert "docs/estimate.md" in lines[1] and "--smoke" in lines[2]
    given = subprocess.run([str(script), "--print", "trainer.total_epochs=1"], capture_output=True, text=True)
    assert given.stderr.startswith("(for the rendered settings: the overrides given here are not counted)")
    smoke = subprocess.run([str(script), "--print", "--smoke"], capture_output=True, text=True, check=True)
    assert smoke.stderr == ""
    # Where the cost model does not reach, it says so instead of guessing.
    v100 = subprocess.run([str(rendered["v100"]["script"]), "--print"], capture_output=True, text=True, check=True)
    assert "estimate: none (the cost model covers the hf rollout on padded sequences only)" in v100.stderr


def test_a_run_with_other_training_settings_gets_a_name_of_its_own(rendered):
    names = {h: as_dict(rendered[h]["overrides"])["trainer.experiment_name"] for h in rendered}
    digests = {h: name.rsplit("-", 1)[1] for h, name in names.items()}
    # p40 and p40x2 differ in GPUs (and p40x2 in an extra override); v100 in precision; a100 in its tier.
    assert len(set(digests.values())) == len(digests), digests
    script = rendered["p40"]["script"]

    def shown(*args):
        done = subprocess.run([str(script), "--print", *args], capture_output=True, text=True, check=True)
        return as_dict(parse_printed(done.stdout))

    # A schedule change keeps the run (a longer run resumes the shorter one's checkpoint) ...
    longer = shown("trainer.total_epochs=30", "trainer.test_freq=5", "trainer.total_training_steps=100")
    assert longer["trainer.experiment_name"] == names["p40"]
    # ... a training change does not, and the same change gets the same name on every start (so it resumes).
    other = shown("actor_rollout_ref.actor.optim.lr=2e-6")
    assert (
        other["trainer.experiment_name"].startswith(names["p40"] + "-")
        and other["trainer.experiment_name"] != names["p40"]
    )
    assert other["trainer.default_local_dir"] == "/srv/verl-runs/checkpoints/" + other["trainer.experiment_name"]
    assert shown("actor_rollout_ref.actor.optim.lr=2e-6") == other
    assert shown("actor_rollout_ref.actor.optim.lr=3e-6")["trainer.experiment_name"] != other["trainer.experiment_name"]
    # A run named by the operator keeps that name.
    named = shown("actor_rollout_ref.actor.optim.lr=2e-6", "trainer.experiment_name=mine")
    assert named["trainer.experiment_name"] == "mine"


def test_smoke_adds_a_tiny_batch_validation_a_save_and_its_own_checkpoints_after_the_rendered_overrides(rendered):
    for host, batch in (("p40", 16), ("p40x2", 32), ("a100", 16)):
        plain, smoke = rendered[host]["overrides"], rendered[host]["smoke"]
        assert smoke[: len(plain)] == plain
        assert smoke[len(plain) :] == [
            "trainer.val_before_train=True",
            "trainer.test_freq=-1",
            "trainer.max_actor_ckpt_to_keep=1",
            "trainer.max_critic_ckpt_to_keep=1",
            "trainer.resume_mode=auto",
            f"data.train_batch_size={batch}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
            "trainer.default_local_dir=/srv/verl-runs/smoke-checkpoints",
            "trainer.total_training_steps=5",
            "trainer.save_freq=5",
        ], host
    script = rendered["p40"]["script"]
    full = parse_printed(
        subprocess.run([str(script), "--print", "--smoke", "2", "--full-batch"], capture_output=True, text=True).stdout
    )
    assert full[-2:] == ["trainer.total_training_steps=2", "trainer.save_freq=2"]
    assert "data.train_batch_size=16" not in full
    # A smoke's checkpoints never land where a run's are, whatever is passed through.
    passed = parse_printed(
        subprocess.run(
            [str(script), "--print", "--smoke", "2", "actor_rollout_ref.actor.optim.lr=2e-6"],
            capture_output=True,
            text=True,
        ).stdout
    )
    assert as_dict(passed)["trainer.default_local_dir"] == "/srv/verl-runs/smoke-checkpoints"
    for bad in (["--full-batch"], ["--smoke", "0"]):
        done = subprocess.run([str(script), "--print", *bad], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr, bad


def test_a_card_whose_tier_cannot_train_is_refused_at_render_time(tmp_path):
    hosts = {
        "p4": {"profile": preflight_profile("Tesla P4", "6.1", 7680, 1)},
        "p100": {"profile": preflight_profile("Tesla P100-PCIE-16GB", "6.0", 16384, 1)},
        "t4": {"profile": preflight_profile("Tesla T4", "7.5", 15360, 1)},
        "p4-small-model": {
            "profile": preflight_profile("Tesla P4", "6.1", 7680, 1),
            "launch_script_allow_refused_tier": True,
        },
    }
    out, result = render(hosts, tmp_path)
    assert "p4: no launch script for 1x Tesla P4 (7680 MiB per GPU, float32)" in out["p4"].refused
    assert "Adam states" in out["p4"].refused and not (tmp_path / "p4" / "train_gsm8k_ppo.sh").exists()
    assert "docs/gpu-runs/p100-1x.json" in out["p100"].refused
    # fp16 profiles train with fp32 autocast (no loss scaler), which ran out of memory on a T4's cap.
    assert "docs/gpu-runs/t4-1x-hf.json" in out["t4"].refused and "fp32 autocast" in out["t4"].refused
    # The switch renders a refused card on purpose.
    assert not out["p4-small-model"].refused
    assert result.rc == 2


def test_script_sets_the_gpus_and_the_side_cuda(rendered):
    text = rendered["p40x2"]["script"].read_text()
    assert "export CUDA_DEVICE_ORDER=PCI_BUS_ID" in text
    assert re.search(r"^export CUDA_VISIBLE_DEVICES=0,1$", text, re.M)
    assert f"export CUDA_HOME={CUDA_HOME}" in text
    assert "$CUDA_HOME/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" in text


def test_passthrough_arguments_are_appended(rendered):
    script = rendered["p40"]["script"]
    printed = subprocess.run([str(script), "--print", "trainer.total_epochs=1"], capture_output=True, text=True)
    assert parse_printed(printed.stdout)[-1] == "trainer.total_epochs=1"


def test_the_runs_environment_is_in_a_0600_file_the_script_sources_never_in_the_script(rendered):
    # A regression: launch_script_environment (a WANDB_API_KEY) landed in the 0755 script anyone can read.
    script = rendered["p40"]["script"]
    env_file = script.with_suffix(".env")
    assert SECRET not in script.read_text()
    assert f". {env_file}" in script.read_text()
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"
    sourced = subprocess.run(
        ["bash", "-c", f'. {env_file} && printf "%s\\n%s" "$WANDB_API_KEY" "$WANDB_MODE"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert sourced.stdout.splitlines() == [SECRET, "offline"]


def run_lone_host(tmp_path, run_playbook, **settings):
    """The role on one local host with the given settings over a minimal P40 host's; the run's result."""
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "p40fleet_env_owner": pwd.getpwuid(os.getuid()).pw_name,
        "p40fleet_conda_env_dir": "/opt/miniconda3/envs/verl-env",
        "p40fleet_conda_python": "/opt/miniconda3/envs/verl-env/bin/python",
        "gpu_preflight_profile": HOSTS["p40"],
        "training_data_train_file": "/srv/train.parquet",
        "training_data_test_file": "/srv/test.parquet",
        "training_data_model_path": "/srv/model",
        "launch_script_path": str(tmp_path / "train_gsm8k_ppo.sh"),
        **settings,
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"p40": host}}}))
    envvars = {"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(tmp_path / "f"), **ROOT_PLAYS_OWNER}
    return run_playbook(PLAYBOOK, inventory, envvars=envvars)


def test_an_environment_name_that_is_no_shell_name_is_refused(tmp_path, run_playbook):
    result = run_lone_host(tmp_path, run_playbook, launch_script_environment={"X=1; touch /tmp/p40fleet-owned #": "v"})
    assert result.rc == 2
    message = " ".join(f.message for f in result.failures)
    assert "p40: launch_script_environment has names that are not shell variable names" in message, message
    assert '"X=1; touch /tmp/p40fleet-owned #"' in message
    assert not (tmp_path / "train_gsm8k_ppo.sh").exists()


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to show the refusal")
def test_script_refuses_root(rendered):
    for mode in ([], ["--dry-run"]):
        done = subprocess.run([str(rendered["p40"]["script"]), *mode], capture_output=True, text=True)
        assert done.returncode == 1
        assert "refusing to run as root" in done.stderr


def test_a_profile_that_needs_patches_refuses_an_unpatched_verl(tmp_path, run_playbook):
    result = run_lone_host(
        tmp_path,
        run_playbook,
        gpu_preflight_profile={**HOSTS["p40"], "needs_patches": True},
        verl_patches_record={"state": "unpatched", "verl_version": "0.4.1", "profile": "pascal"},
    )
    assert result.rc == 2
    assert any("needs verl's source patches" in f.message for f in result.failures), result.failures
    assert not (tmp_path / "train_gsm8k_ppo.sh").exists()


# --- On sandbox hosts: site.yml end to end, then the scripts run on the hosts ---------------------
SANDBOX_HUB_TOKEN = "hf_p40fleetSandboxStandinToken0123456789"
ENV_OWNER = "p40fleet"


@pytest.fixture(scope="module")
def converged(site_fleet):
    """The shared whole-pipeline fleet (conftest.py): node1 one P40, node2 two."""
    return {"fleet": site_fleet, "first": site_fleet.first, "second": site_fleet.second}


@pytest.mark.sandbox
@pytest.mark.converge
def test_site_yml_converges_and_a_second_run_changes_nothing(converged):
    first, second = converged["first"], converged["second"]
    assert first.rc == 0, "\n".join(f.message for f in first.failures) or first.stdout[-4000:]
    assert second.rc == 0, second.stdout[-4000:]
    assert {h: s["changed"] for h, s in second.stats.items()} == {"node1": 0, "node2": 0}, second.stdout[-4000:]


@pytest.mark.sandbox
@pytest.mark.converge
def test_scripts_differ_in_gpu_count_between_one_and_two_p40s(converged):
    fleet = converged["fleet"]
    printed = {}
    for host in ("node1", "node2"):
        done = fleet.exec(host, f"~{ENV_OWNER}/train_gsm8k_ppo.sh --print", user=ENV_OWNER)
        assert done.returncode == 0, done.stderr
        printed[host] = as_dict(parse_printed(done.stdout))
    one, two = printed["node1"], printed["node2"]
    assert one["trainer.n_gpus_per_node"] == "1" and two["trainer.n_gpus_per_node"] == "2"
    # Neither offloads parameters: the 24 GB tier keeps the critic on the GPU (docs/gpu-runs/sweep/p40-1x.json).
    for printed_by in (one, two):
        assert printed_by["actor_rollout_ref.actor.fsdp_config.param_offload"] == "False"
        assert printed_by["critic.model.fsdp_config.param_offload"] == "False"
    assert one["data.val_batch_size"] == "256" and two["data.val_batch_size"] == "512"
    assert one["data.train_files"].endswith("/train.parquet")
    visible = fleet.exec("node2", f"grep '^export CUDA_VISIBLE_DEVICES=' ~{ENV_OWNER}/train_gsm8k_ppo.sh")
    assert visible.stdout.strip() == "export CUDA_VISIBLE_DEVICES=0,1"


@pytest.mark.sandbox
@pytest.mark.converge
def test_dry_run_composes_against_the_installed_verl_as_the_env_owner(converged):
    fleet = converged["fleet"]
    for host in ("node1", "node2"):
        done = fleet.exec(host, f"~{ENV_OWNER}/train_gsm8k_ppo.sh --dry-run", user=ENV_OWNER)
        assert done.returncode == 0, done.stderr
        composed = yaml.safe_load(done.stdout)
        assert composed["actor_rollout_ref"]["rollout"]["name"] == "hf"
        assert composed["actor_rollout_ref"]["actor"]["fsdp_config"]["mixed_precision"]["param_dtype"] == "fp32"
    bad = fleet.exec("node1", f"~{ENV_OWNER}/train_gsm8k_ppo.sh --dry-run trainer.no_such_key=1", user=ENV_OWNER)
    assert bad.returncode == 1 and "no_such_key" in bad.stderr
    root = fleet.exec("node1", f"~{ENV_OWNER}/train_gsm8k_ppo.sh --dry-run")
    assert root.returncode == 1 and "refusing to run as root" in root.stderr


@pytest.mark.sandbox
@pytest.mark.converge
def test_smoke_fails_clearly_without_a_gpu_and_the_report_shows_it(converged, run_playbook):
    """The sandbox's torch is a stand-in with no CUDA kernels: a smoke run there must fail, saying why."""
    fleet = converged["fleet"]
    done = fleet.exec("node1", f"~{ENV_OWNER}/train_gsm8k_ppo.sh --smoke 1", user=ENV_OWNER)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "smoke: FAIL steps 0/1" in done.stdout and "no CUDA GPU is usable here" in done.stdout
    result = run_playbook("playbooks/smoke.yml", fleet.inventory_dir, extra_vars={"launch_script_smoke_steps": 1})
    assert result.rc == 2
    messages = {f.host: f.message for f in result.failures}
    assert set(messages) == {"node1", "node2"}, messages
    assert "node1: the smoke run of" in messages["node1"] and "(0 of 1 steps, exit 1)" in messages["node1"]
    assert "no CUDA GPU is usable here" in messages["node1"]
    kept = json.loads(fleet.exec("node1", "cat /var/lib/p40fleet/smoke.json").stdout)
    assert kept["ok"] is False and kept["steps_wanted"] == 1 and kept["summary"].startswith("smoke: FAIL")
    owner = fleet.exec("node1", "stat -c '%U %a' /var/lib/p40fleet/smoke.json").stdout.split()
    assert owner == ["root", "644"]
    # The run's events carry each host's verdict into the fleet report.
    verdicts = smoke_results(result.events)
    assert verdicts["node2"]["ok"] is False and verdicts["node2"]["steps_done"] == 0


@pytest.mark.sandbox
@pytest.mark.converge
def test_the_data_files_on_the_host_are_in_verls_layout(converged):
    fleet = converged["fleet"]
    script = (
        "import json, pyarrow.parquet as pq; t = pq.read_table('/opt/p40fleet/data/gsm8k/train.parquet');"
        "print(json.dumps({'names': t.column_names, 'rows': t.to_pylist()}))"
    )
    done = fleet.exec("node1", f'/opt/miniconda3/envs/verl-env/bin/python -c "{script}"', user=ENV_OWNER)
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)
    assert table["names"] == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    first = table["rows"][0]
    assert first["reward_model"] == {"style": "rule", "ground_truth": "1234"}
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert {r["reward_model"]["ground_truth"] for r in table["rows"]} >= {"-5", "-3000", "30000", "2.5"}


@pytest.mark.sandbox
@pytest.mark.converge
def test_the_token_appears_in_no_artifact(converged):
    fleet = converged["fleet"]
    found = []
    for run in ("first", "second"):
        private = converged[run].artifact_dir.parent.parent
        found += [str(p) for p in private.rglob("*") if p.is_file() and SANDBOX_HUB_TOKEN.encode() in p.read_bytes()]
        assert SANDBOX_HUB_TOKEN not in converged[run].stdout
    for host in ("node1", "node2"):
        done = fleet.exec(host, f"grep -rl {SANDBOX_HUB_TOKEN} /opt /home /root /tmp /var/tmp /var/log /etc || true")
        found += [f"{host}:{line}" for line in done.stdout.split()]
    assert found == []
