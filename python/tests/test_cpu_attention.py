"""Eager and SDPA attention agree in fp32 on left-padded prompts (tests/cpu/attention_parity.py, in the CPU venv).

The step-time sweep (tests/gpu/sweep.py) times SDPA against the Pascal profile's eager attention; this holds the
precondition on the real transformers and torch of the CPU venv: logits at real tokens within 1e-5. A parity that
could not fail would be no check: the same script with the padding mask dropped for SDPA must differ.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from p40fleet_dev import cpu_venv
from p40fleet_dev.paths import REPO_ROOT

SCRIPT = REPO_ROOT / "python" / "tests" / "cpu" / "attention_parity.py"


@pytest.fixture(scope="module")
def python():
    return str(cpu_venv.python())


def run(python, source):
    done = subprocess.run([python, "-c", source], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_eager_and_sdpa_logits_agree_at_real_tokens(python):
    found = run(python, SCRIPT.read_text())
    assert found["attn"] == ["sdpa"]
    assert found["real_tokens"] > 100
    assert found["max_abs_logit"] > 0.01, found
    assert found["max_abs_diff"] <= 1e-5, found


def test_the_parity_sees_a_wrong_mask(python):
    """SDPA without the padding mask lets real tokens attend to the padding: the check must catch that."""
    broken = SCRIPT.read_text().replace(
        "logits[kind] = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits",
        "logits[kind] = model(input_ids=ids, attention_mask=mask if kind == 'eager' else None,"
        " position_ids=positions).logits",
    )
    assert broken != SCRIPT.read_text()
    found = run(python, broken)
    assert found["max_abs_diff"] > 1e-3, found
