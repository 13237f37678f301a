"""The GPU check's cases: which rendering of the launch script is run, as which card.

One case per memory tier and precision the launch script renders: the 1x P40 (24 GB tier, fp32), the
P100 (16 GB tier), the P4 (8 GB tier: refused at render time) and one fp16-capable card, the T4. A case's card is the
memory it reports (memory_mib, as nvidia-smi prints it): for the P40 22,888 MiB, the smallest total quoted for one with
ECC on (real ones print 22,919 or 23,040; docs/facts-memory.md). The GPU check caps torch at that total less what a
process holds outside torch's allocator on the GPU machine, measured there before the runs (tests/gpu/device_memory.py,
run_check.py), and judges each run's whole-device peak against the total. cap_gib is the fixed cap the earlier runs of
the refused cases ran under (their records keep it: 15 GiB for a P100's 16,384 MiB, 7 for a P4's 7,680 and 14 for a
T4's 15,360); a case without one is capped from the probe. fp32 profiles run with TF32 off (Pascal has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.launch_render import preflight_profile


@dataclass(frozen=True)
class Case:
    gpu_name: str
    compute_cap: str
    memory_mib: int
    gpu_count: int
    cap_gib: float | None
    # launch_script variables a fleet would set for this rendering (nothing for the profiles as they come).
    variables: dict = field(default_factory=dict)
    why: str = ""
    # What the check runs: smoke steps on the tiny batch, then steps at the rendered batch sizes. Each smoke also
    # validates first, saves at its last step and resumes for one more (the launch script's --smoke).
    smoke_steps: int = 5
    full_steps: int = 1

    @property
    def profile(self) -> dict:
        return preflight_profile(self.gpu_name, self.compute_cap, self.memory_mib, self.gpu_count)

    def host(self) -> dict:
        return {"profile": self.profile, **self.variables}


CASES = {
    "p40-1x": Case("Tesla P40", "6.1", 22888, 1, None),
    "p100-1x": Case("Tesla P100-PCIE-16GB", "6.0", 16384, 1, 15),
    "p4-1x": Case("Tesla P4", "6.1", 7680, 1, 7),
    # The T4's rendering with the hf rollout, set explicitly: its profile names vLLM, which p40fleet no longer
    # installs (so hf is also its default now), and which could not be carried to the GPU machine anyway (its cu118
    # wheel alone is several times the 64 MiB a call may carry).
    "t4-1x-hf": Case(
        "Tesla T4",
        "7.5",
        15360,
        1,
        14,
        variables={"launch_script_rollout_name": "hf"},
        why="the T4's rendering with launch_script_rollout_name=hf (vLLM cannot be carried to the GPU machine)",
    ),
    # Two GPUs of one host: needs a machine with two GPUs.
    "p40-2x": Case("Tesla P40", "6.1", 22888, 2, None),
    # The learning proof's reference (tests/gpu/learning.py): the modern profile, verl's own bf16 autocast, patched
    # only for the attention and the hf rollout. Not a card p40fleet targets: no smoke of its own.
    "a100-1x": Case(
        "A100-SXM4-80GB",
        "8.0",
        81920,
        1,
        78,
        why="the bf16 reference of the learning proof (the modern profile, no Pascal patches)",
        smoke_steps=0,
        full_steps=0,
    ),
}
