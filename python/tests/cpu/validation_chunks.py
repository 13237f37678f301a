"""In the CPU venv: verl's validation batches through its real padding, dispatch split and HFRollout chunking.

usage: python validation_chunks.py ROWS CASES_JSON   (verl's source first on PYTHONPATH; prints one JSON object)

CASES_JSON is a list of {"world_size": W, "micro_batch_size": M, "val_batch_size": B or null}. For each case the
ROWS-row test set is cut as verl 0.4.1's val dataloader cuts it (batches of B, the last one short; B null: one batch
of every row, verl/trainer/ppo/ray_trainer.py:512-514), each batch is padded to a multiple of W
(pad_dataproto_to_divisor, as _validate does), split across the W ranks as the DP_COMPUTE_PROTO dispatch splits it,
and each rank's share goes through HFRollout.generate_sequences, whose chunking is verl's own; only the generation
of a chunk is left out (it returns its prompts). A case reports "ok" or the error verl raised.
"""

from __future__ import annotations

import json
import sys

import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.protocol import pad_dataproto_to_divisor
from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
from verl.workers.rollout.hf_rollout import HFRollout


class Chunking(HFRollout):
    """verl's HFRollout with generation left out: what generate_sequences chunks, and how, is verl's."""

    def _generate_minibatch(self, prompts: DataProto) -> DataProto:
        return prompts


def batches(rows: int, size: int | None) -> list[int]:
    size = size or rows
    return [min(size, rows - start) for start in range(0, rows, size)]


def run(rows: int, case: dict) -> str:
    rollout = Chunking(None, OmegaConf.create({"micro_batch_size": case["micro_batch_size"]}))
    try:
        for count in batches(rows, case["val_batch_size"]):
            batch = DataProto.from_dict(tensors={"input_ids": torch.arange(count).unsqueeze(1)})
            padded, _ = pad_dataproto_to_divisor(batch, case["world_size"])
            (shares,), _ = _split_args_kwargs_data_proto(case["world_size"], padded)
            for share in shares:
                rollout.generate_sequences(share)
    except AssertionError as error:
        return f"AssertionError: {error}"
    return "ok"


def main() -> None:
    rows, cases = int(sys.argv[1]), json.loads(sys.argv[2])
    print(json.dumps([{**case, "result": run(rows, case)} for case in cases]))


if __name__ == "__main__":
    main()
