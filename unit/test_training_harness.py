"""fixtures.training's pipeline and logging options, and fixtures.oracles, on one process.

The multi-rank behaviour (PP, VPP, DP x PP memory logging) is proven in
functional/test_pp_memory.py; here the options' validation and mapping, the step/log split on a
1-rank Trainer, and the shared oracles against hand-computed values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fixtures.oracles import max_over_ranks, megatron_lm_step_flops, reference_stats
from fixtures.training import DenseBatch, ModelConfig, ParallelConfig, TrainConfig
from megatron_testkit import skips

pytestmark = [pytest.mark.L0]


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"pp": 0}, r"ParallelConfig.pp = 0 must be at least 1"),
        ({"cp": -1}, r"ParallelConfig.cp = -1"),
        ({"pp": 1, "vpp": 2}, r"vpp = 2 with pp = 1: a virtual pipeline needs"),
        ({"pp": 2, "vpp": 1}, r"vpp = 1 with pp = 2"),
    ],
)
def test_parallel_config_refuses_impossible_layouts(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**fields)


def test_virtual_pipeline_gives_chunks_and_reaches_the_transformer_config() -> None:
    assert ParallelConfig(pp=2).chunks == 1
    parallel = ParallelConfig(pp=2, vpp=3)
    assert parallel.chunks == 3
    config = ModelConfig(num_layers=6).transformer_config(parallel)
    assert (config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size) == (2, 3)
    assert ModelConfig().transformer_config(ParallelConfig()).virtual_pipeline_model_parallel_size is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"memory_group": "pp"}, r"memory_group = 'pp': expected one of \('world', 'pipeline'\)"),
        ({"log_interval": 0}, r"log_interval = 0 must be at least 1"),
    ],
)
def test_train_config_refuses_unknown_logging_options(fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TrainConfig(**fields)


# ------------------------------------------------------------------------------------- oracles


def test_max_over_ranks_keeps_the_winners_value_and_type_and_the_lowest_rank_on_ties() -> None:
    reports = {
        0: {"peak": 7, "ooms": 0, "frac": 0.25, "flag": False},
        2: {"peak": 9, "ooms": 0, "frac": 0.5, "flag": True},
        5: {"peak": 9, "ooms": 1, "frac": 0.125, "flag": True},
    }
    values, ranks = max_over_ranks(reports)
    assert values == {"peak": 9, "ooms": 1, "frac": 0.5, "flag": True}
    assert [type(v) for v in values.values()] == [int, int, float, bool]
    assert ranks == {"peak": 2, "ooms": 5, "frac": 2, "flag": 2}
    assert list(values) == ["peak", "ooms", "frac", "flag"]  # the first report's key order


def test_max_over_ranks_refuses_reports_with_other_keys() -> None:
    with pytest.raises(ValueError, match=r"rank 1 reports keys \['b'\], not \['a'\]"):
        max_over_ranks({0: {"a": 1}, 1: {"b": 1}})
    with pytest.raises(ValueError, match="no reports"):
        max_over_ranks({})


def test_reference_stats_of_a_small_vector_by_hand() -> None:
    want = {
        "min": 1.0,
        "max": 4.0,
        "mean": 2.5,
        "std": math.sqrt(5 / 3),  # unbiased: sum of squared deviations 5, over n - 1 = 3
        "l1_norm": 10.0,
        "l2_norm": math.sqrt(30),
        "nan_count": 0,
        "inf_count": 0,
    }
    for value in (np.array([1.0, 2.0, 3.0, 4.0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])):
        got = reference_stats(value)
        assert got == pytest.approx(want, rel=1e-15)
        assert type(got["nan_count"]) is int and type(got["inf_count"]) is int
    counted = reference_stats(np.array([1.0, np.nan, np.inf, -np.inf]))
    assert (counted["nan_count"], counted["inf_count"]) == (1, 2)


def test_megatron_lm_step_flops_by_hand_and_against_the_library() -> None:
    # L=1, h=2, one head (kv 2), ffn 4, GeLU, V=3, one document of 2 tokens:
    # per token 6*2*(2+2*2) + 6*2*2 + 6*2*4*2 + 6*2*3 = 72 + 24 + 96 + 36 = 228; 2 tokens;
    # attention 6*L*Q*s^2 = 6*1*2*4 = 48.
    tiny = ModelConfig(
        num_layers=1,
        hidden_size=2,
        ffn_hidden_size=4,
        num_attention_heads=1,
        num_query_groups=1,
        vocab_size=3,
        gated_linear_unit=False,
    )
    assert megatron_lm_step_flops(tiny, [2]) == 2 * 228 + 48
    # The library's causal convention on the harness' default shape, from its published definition.
    from accounting import ModelShape, SeqlenStats, training_flops

    m = ModelConfig()
    shape = ModelShape(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        vocab_size=m.vocab_size,
        gated_linear_unit=m.gated_linear_unit,
    )
    lengths = [64, 64, 64]
    assert training_flops(shape, SeqlenStats.dense(3, 64)).total == megatron_lm_step_flops(m, lengths)


# --------------------------------------------------------------------- the 1-rank step/log split


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A 1-rank gloo default group for the test only (the session guard forbids leaks)."""
    from fixtures.megatron import destroy_model_parallel

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        destroy_model_parallel()
        dist.destroy_process_group()


@skips.skip_if(torch.cuda.is_available(), "no-cuda", "CPU harness check (the GPU path is functional)")
def test_step_leaves_logging_to_log_which_reduces_over_the_configured_group(
    one_rank_group: None, tmp_path: Path
) -> None:
    from fixtures.megatron import cpu_shim
    from fixtures.tensorboard import read_scalars
    from fixtures.training import Trainer

    torch.set_num_threads(1)
    model = ModelConfig(
        num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=64, max_sequence_length=16
    )
    train = TrainConfig(
        packed=False, tensorboard_dir=str(tmp_path / "tb"), tensorboard_rank=-1, memory_group="pipeline"
    )
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [DenseBatch(tokens[:, :-1], tokens[:, 1:], torch.ones(2, 16))]
    with cpu_shim():
        trainer = Trainer(model, ParallelConfig(), train)
        assert trainer.writer is not None  # rank -1 of a 1-rank world is rank 0
        result = trainer.step(batch)
        assert result.iteration == 1 and result.step_flops > 0
        assert result.memory is None and result.memory_ranks is None and result.tflops_per_gpu is None
        logged = trainer.log(result)
        assert logged is result
        # A pipeline group of one: the reduction is the rank's own report, held by rank 0.
        assert result.memory == result.local_memory and result.memory_ranks == dict.fromkeys(result.memory, 0)
        assert result.tflops_per_gpu is not None and result.tflops_per_gpu > 0
        trainer.close()
    scalars = read_scalars(tmp_path / "tb")
    assert [step for step, _ in scalars["loss"]] == [1]
    assert {t for t in scalars if t.startswith("memory/")} == {f"memory/{k}" for k in result.local_memory}
