"""In the CPU venv: verl 0.4.1's own start-up checks of a launch script's batch sizes, at the script's world size.

usage: python startup_checks.py CASES_FILE   (verl's source first on PYTHONPATH; prints one JSON object)

CASES_FILE holds a JSON list of {"name": ..., "overrides": [the script's --print overrides]}. For each case, verl's
PPO config is composed with the overrides by Hydra from verl's own ppo_trainer.yaml and resolved (as main_ppo does),
then:
- RayPPOTrainer._validate_config, verl's own method, runs on it (ray_trainer.py:363-481: the train batch split across
  trainer.n_gpus_per_node x trainer.nnodes ranks, line 377, and the micro batch settings), with the two attributes
  RayPPOTrainer.__init__ sets before calling it (a reference policy only with a KL term, main_ppo.py:155; a critic
  under GAE);
- verl's FSDP workers are constructed as the trainer's worker groups construct them (ActorRolloutRefWorker with role
  actor_rollout, CriticWorker), each in a process group of the world size (torch's fake backend: one process plays
  rank 0 of W), so that their config normalisation runs (fsdp_workers.py:156-166 and :857-868: the mini batch per
  rank a multiple of the micro batch); no model is built;
- each rank's share of the train batch goes through HFRollout.generate_sequences' chunking (hf rollout only;
  hf_rollout.py:47-48 and DataProto.chunk), generation itself left out as tests/cpu/validation_chunks.py leaves it.
A case reports "ok" or the first error verl raised, with the check that raised it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import verl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore
from verl import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.workers.fsdp_workers import ActorRolloutRefWorker, CriticWorker
from verl.workers.rollout.hf_rollout import HFRollout

CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


class Chunking(HFRollout):
    """verl's HFRollout with generation left out: what generate_sequences chunks, and how, is verl's."""

    def _generate_minibatch(self, prompts: DataProto) -> DataProto:
        return prompts


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    OmegaConf.resolve(config)
    return config


def workers(config, world: int, found: dict) -> None:
    """Construct both workers at `world` ranks; `found` gets the mini batches per rank they normalised to."""
    os.environ.update({"WORLD_SIZE": str(world), "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        actor = ActorRolloutRefWorker(config.actor_rollout_ref, role="actor_rollout")
        found["actor_mini_per_rank"] = actor.config.actor.ppo_mini_batch_size
        critic = CriticWorker(config.critic)
        found["critic_mini_per_rank"] = critic.config.ppo_mini_batch_size
    finally:
        dist.destroy_process_group()


def rollout_chunks(config, world: int) -> None:
    rollout = config.actor_rollout_ref.rollout
    if rollout.name != "hf":
        return
    share = config.data.train_batch_size * rollout.n // world
    chunking = Chunking(None, OmegaConf.create({"micro_batch_size": rollout.get("micro_batch_size", None)}))
    chunking.generate_sequences(DataProto.from_dict(tensors={"input_ids": torch.arange(share).unsqueeze(1)}))


def run(case: dict) -> dict:
    config = composed(case["overrides"])
    world = config.trainer.n_gpus_per_node * config.trainer.nnodes
    found = {"name": case["name"], "world_size": world, "train_batch_size": config.data.train_batch_size}
    found["ppo_mini_batch_size"] = config.actor_rollout_ref.actor.ppo_mini_batch_size
    trainer = SimpleNamespace(
        config=config,
        use_reference_policy=config.algorithm.use_kl_in_reward or config.actor_rollout_ref.actor.use_kl_loss,
        use_critic=config.algorithm.adv_estimator == "gae",
    )
    for check, step in (
        ("RayPPOTrainer._validate_config", lambda: RayPPOTrainer._validate_config(trainer)),
        ("fsdp_workers normalisation", lambda: workers(config, world, found)),
        ("HFRollout chunking", lambda: rollout_chunks(config, world)),
    ):
        try:
            step()
        except (AssertionError, ValueError) as error:
            return {**found, "result": f"{check}: {type(error).__name__}: {error}"}
    return {**found, "result": "ok"}


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([run(case) for case in cases]))


if __name__ == "__main__":
    main()
