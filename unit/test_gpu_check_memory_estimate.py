"""The gpu-check step `memory_estimate` in its dry run: the fused formula equals what CPU flash attention keeps.

On the GPU the same step runs torch's CUDA flash attention in bf16 (ci/gpu_check/memory_estimate.py).
"""

from __future__ import annotations

import pytest

from ci.gpu_check import STEPS, memory_estimate
from ci.gpu_check.summary import CheckState

pytestmark = pytest.mark.L0


def test_the_dry_run_finds_the_fused_formula_in_what_flash_attention_saves(tmp_path):
    figures = memory_estimate.step(CheckState(tmp_path, dry_run=True, budget_s=60))
    heads, head_dim, lengths = memory_estimate.CPU_SHAPE
    for seq_len in lengths:
        row = figures[str(seq_len)]
        # Q, K, V and the output in fp32 (4 bytes), and one fp32 statistic per query and head.
        assert (
            row["saved_bytes"]
            == row["formula_bytes"]
            == 4 * 4 * seq_len * heads * head_dim + 4 * heads * seq_len
        )
        assert "Flash" in row["kernel"]
    assert "memory_estimate" in STEPS


def test_the_unfused_attention_keeps_scores_and_would_fail_the_check():
    # Control: the math (unfused) kernel keeps s x s scores, so its bytes grow faster than the formula's.
    heads, head_dim, (s1, s2) = memory_estimate.CPU_SHAPE
    import torch

    math = [
        memory_estimate.saved_attention_bytes(heads, head_dim, s, "cpu", torch.float32, "MATH")[0]
        for s in (s1, s2)
    ]
    formula = [memory_estimate.formula_attention_bytes(heads, head_dim, s, 4) for s in (s1, s2)]
    assert math[0] > formula[0] and math[1] - formula[1] > 2 * (math[0] - formula[0])
