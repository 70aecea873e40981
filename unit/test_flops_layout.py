"""Model FLOPs and tokens per step do not depend on the parallel layout: TP, PP, VPP, CP, EP, SP.

They are properties of the model and the global batch. Megatron-Bridge shipped 9.95x the FLOPs at
virtual pipeline size 10 and another VPP division error of -50..+87%, caught only by Megatron-LM's
golden values. Here every layout of TP {1,2,4,8} x PP {1,2,4} x VPP {none,2,4,10} x CP {1,2,4} x EP
{1,8} x sequence parallel {off,on} that megatron-core's own config accepts is built as a real
`TransformerConfig` / `MLATransformerConfig` for four models (dense GQA + SwiGLU, MoE with a shared
expert, MLA + MoE + MTP, and a Mamba/attention/MoE hybrid whose pattern carries one `|` cut per
pipeline stage and virtual chunk, as megatron wants it), and:

- `ModelShape.from_megatron` gives the same shape for every layout (the hybrid's `|` cuts too);
- `training_flops` of one global batch (a packed THD batch) is identical, term by term, and for the
  dense model equals Megatron-LM's formula computed here (`fixtures.oracles`);
- a `FlopsAccumulator` driven the way megatron's schedule drives it on one data-parallel rank
  (DP = 128 GPUs / (TP x PP x CP), each rank's share of a fixed global batch, every micro batch
  reported once per virtual-pipeline chunk with its `vp_stage`) counts the same step FLOPs and tokens.

Configs only, no process groups: the whole file runs in a few seconds. The padded vocabulary is an
input (`vocab_size`): it is chosen as a multiple of 128 x 8 so that Megatron-LM's padding rule
(a multiple of 128 x TP) gives the same size for every TP here; a caller who pads per TP changes
the logits term with TP, as Megatron-LM's own formula does.

Checked to fail (then reverted): with `accounting/megatron_config.py` temporarily reading
`num_layers // (virtual_pipeline_model_parallel_size or 1)` (the Megatron-Bridge VPP bug), 12 of
the 15 tests went red: the dense model gave another ModelShape under 189 of its 252 layouts (every
VPP layout) and other FLOPs, and the MoE, MLA and hybrid models could not even be built (their
per-layer lists no longer fit the halved layer count). With the accumulator's VPP de-duplication
temporarily removed (every chunk's `add_microbatch` counted), the schedule test went red for all
four models at the first VPP layout (VPP 2: the step counted twice).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from accounting import FlopsAccumulator, ModelShape, SeqlenStats, seqlen_stats, training_flops
from fixtures.oracles import megatron_lm_step_flops
from megatron_testkit import skips

pytestmark = pytest.mark.L0

NUM_LAYERS = 80  # divisible by every PP x VPP here (up to 4 x 10 = 40 model chunks)
VOCAB = 1024  # a multiple of 128 x 8: Megatron-LM pads it to itself for every TP here
WORLD = 128  # GPUs; DP = WORLD / (TP x PP x CP) is a whole number for every layout here
GLOBAL_ROWS, ROW_LEN = 128, 32  # the global batch of the accumulator test: 128 rows of 32 tokens

TP, PP, VPP, CP, EP, SP = (1, 2, 4, 8), (1, 2, 4), (None, 2, 4, 10), (1, 2, 4), (1, 8), (False, True)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One parallel layout (the fields of megatron's `ModelParallelConfig` it sets)."""

    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    sp: bool

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank, and `|`-separated segments per pipeline stage x chunk."""
        return self.vpp or 1

    @property
    def dp(self) -> int:
        return WORLD // (self.tp * self.pp * self.cp)

    def config_fields(self) -> dict[str, Any]:
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "sequence_parallel": self.sp,
            "pipeline_dtype": torch.float32,
        }


REFERENCE = Layout(tp=1, pp=1, vpp=None, cp=1, ep=1, sp=False)

# ------------------------------------------------------------------------------------ the models

_BASE = {
    "num_layers": NUM_LAYERS,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "ffn_hidden_size": 128,
    "gated_linear_unit": True,
    "add_bias_linear": False,
}
_MOE = {
    "num_moe_experts": 16,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "moe_layer_freq": [0] + [1] * (NUM_LAYERS - 1),  # a dense first layer, as DeepSeek-V3
}
_MLA = {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 8}
_MAMBA = {"mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_state_dim": 16, "mamba_num_groups": 2}
HYBRID_LAYERS = "M*ME" * (NUM_LAYERS // 4)  # Mamba, attention, Mamba, MoE, repeated


def hybrid_pattern(layout: Layout) -> str:
    """The hybrid's layers cut by `|` into PP x VPP equal segments (megatron's pipeline layout)."""
    segments = layout.pp * layout.chunks
    size = NUM_LAYERS // segments
    return "|".join(HYBRID_LAYERS[i * size : (i + 1) * size] for i in range(segments))


def _transformer_config(**fields: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**fields)


def _mla_config(**fields: Any) -> Any:
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(**fields)


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of the test: how to build its megatron config and its hybrid pattern, if any."""

    name: str
    build: Callable[..., Any]
    fields: dict[str, Any]
    hybrid: bool = False

    @property
    def has_experts(self) -> bool:
        return "num_moe_experts" in self.fields

    def config(self, layout: Layout) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron's deprecation notes on defaults: not what is tested
            return self.build(**_BASE, **self.fields, **layout.config_fields())

    def shape(self, layout: Layout) -> ModelShape:
        pattern = hybrid_pattern(layout) if self.hybrid else None
        return ModelShape.from_megatron(self.config(layout), VOCAB, hybrid_pattern=pattern)


MODELS = {
    "dense": Model("dense", _transformer_config, {"num_query_groups": 4}),
    "moe": Model("moe", _transformer_config, {"num_query_groups": 4, **_MOE}),
    "mla": Model("mla", _mla_config, {**_MLA, **_MOE, "mtp_num_layers": 1}),
    "hybrid": Model(
        "hybrid",
        _transformer_config,
        {"num_query_groups": 4, "is_hybrid_model": True, **_MAMBA, **{k: _MOE[k] for k in list(_MOE)[:4]}},
        hybrid=True,
    ),
}


def layouts(model: Model) -> list[Layout]:
    """Every layout of the grid that megatron-core accepts for `model`.

    megatron-core refuses sequence parallelism without tensor parallelism, and expert parallelism
    without experts; no other combination is left out (the count is asserted).
    """
    out = []
    for tp, pp, vpp, cp, ep, sp in itertools.product(TP, PP, VPP, CP, EP, SP):
        if (sp and tp == 1) or (ep > 1 and not model.has_experts):
            continue
        out.append(Layout(tp, pp, vpp, cp, ep, sp))
    return out


@pytest.fixture(scope="module", autouse=True)
def _megatron() -> None:
    skips.require_megatron(why="the test builds real megatron-core configs")


@functools.cache
def shapes(name: str) -> dict[Layout, ModelShape]:
    """`name`'s shape under every layout it accepts (built once per model: up to ~500 configs)."""
    model = MODELS[name]
    return {layout: model.shape(layout) for layout in layouts(model)}


def global_batch() -> SeqlenStats:
    """A packed THD global batch: two packs of 160 slots, documents padded to multiples of 8."""
    cu = torch.tensor([[0, 37, 42, 132, 133], [0, 150, 150, 150, 150]])  # a repeated-last-value tail
    padded = torch.tensor([[0, 40, 48, 144, 152], [0, 152, 152, 152, 152]])
    return seqlen_stats(cu, padded, pack_len=160)


# ------------------------------------------------------------------------------------ the tests


def test_the_grid_is_every_layout_megatron_accepts():
    # 4 TP x 3 PP x 4 VPP x 3 CP x 2 EP x 2 SP = 576, less SP without TP (3 x 4 x 3 x 2 = 72);
    # a model without experts also drops EP = 8 (the other half of the remaining 504).
    assert len(layouts(MODELS["moe"])) == 576 - 72
    assert len(layouts(MODELS["dense"])) == (576 - 72) // 2
    # A layout outside the filter is refused by megatron-core itself, so it cannot be counted.
    with pytest.raises(ValueError, match="sequence parallelism"):
        MODELS["dense"].config(dataclasses.replace(REFERENCE, sp=True))
    with pytest.raises(ValueError, match="expert"):
        MODELS["dense"].config(dataclasses.replace(REFERENCE, ep=8))


@pytest.mark.parametrize("name", ["dense", "moe", "mla", "hybrid"])
def test_the_model_shape_is_the_same_for_every_layout(name):
    reference = shapes(name)[REFERENCE]
    differing = [layout for layout, shape in shapes(name).items() if shape != reference]
    assert not differing, f"{name}: {len(differing)} layouts give another ModelShape, e.g. {differing[0]}"


def test_the_pipeline_cuts_of_a_hybrid_pattern_are_layout_not_model():
    reference = shapes("hybrid")[REFERENCE]
    assert reference.hybrid_pattern == HYBRID_LAYERS  # one segment: no cut
    for layout, shape in shapes("hybrid").items():
        # megatron is given the pattern cut into PP x VPP segments; the shape keeps the layers only.
        assert hybrid_pattern(layout).count("|") == layout.pp * layout.chunks - 1
        assert shape.hybrid_pattern == HYBRID_LAYERS and shape == reference, layout


@pytest.mark.parametrize("name", list(MODELS))
def test_training_flops_of_the_global_batch_are_the_same_for_every_layout(name):
    stats = global_batch()
    reference = training_flops(shapes(name)[REFERENCE], stats)
    assert reference.total > 0 and reference.hardware_total > reference.total  # padding runs
    for layout, shape in shapes(name).items():
        got = training_flops(shape, stats)
        assert (got.total, got.hardware_total, got.terms) == (
            reference.total,
            reference.hardware_total,
            reference.terms,
        ), f"{name} under {layout}"


def test_the_dense_reference_is_megatron_lms_formula():
    # Independent of the code under test: Megatron-LM's num_floating_point_operations for the
    # dense model, with T and the sum of s^2 from the documents' real lengths.
    @dataclasses.dataclass
    class Dense:
        num_layers: int = NUM_LAYERS
        hidden_size: int = 64
        num_attention_heads: int = 8
        num_query_groups: int = 4
        ffn_hidden_size: int = 128
        gated_linear_unit: bool = True
        vocab_size: int = VOCAB

    shape = MODELS["dense"].shape(REFERENCE)
    lengths = [37, 5, 90, 1, 150]
    assert training_flops(shape, global_batch()).total == megatron_lm_step_flops(Dense(), lengths)


def _scheduled_step(shape: ModelShape, layout: Layout) -> tuple[int, int]:
    """One DP rank's accumulator, fed as megatron's schedule feeds it; returns (step FLOPs, tokens).

    Each DP rank holds GLOBAL_ROWS / DP rows, one micro batch each (BSHD, ROW_LEN tokens); under a
    virtual pipeline every model chunk's forward step reports every micro batch with its
    `vp_stage`. The dense accumulator extrapolates to the global batch with `dp_size`.
    """
    acc = FlopsAccumulator(packed=False, dp_size=layout.dp)
    for _ in range(GLOBAL_ROWS // layout.dp):
        for chunk in range(layout.chunks):
            acc.add_microbatch(
                seq_len=ROW_LEN, micro_batch_size=1, vp_stage=chunk if layout.vpp is not None else None
            )
    return acc.step(shape), acc.total_tokens


@pytest.mark.parametrize("name", list(MODELS))
def test_an_accumulator_fed_by_the_schedule_counts_the_same_step_under_every_layout(name):
    expected = training_flops(shapes(name)[REFERENCE], SeqlenStats.dense(GLOBAL_ROWS, ROW_LEN)).total
    for layout, shape in shapes(name).items():
        if layout.ep != 1 or layout.sp:
            continue  # EP and SP change neither the shape (tested above) nor what a rank reports
        assert _scheduled_step(shape, layout) == (expected, GLOBAL_ROWS * ROW_LEN), f"{name} under {layout}"
