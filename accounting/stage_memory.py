"""Memory of each pipeline stage before the run: parameters, static bytes, activations, total.

For each stage, the figures are those of its most loaded rank (every TP/CP/DP rank of a stage
holds the same amount here; EP ranks hold equal expert shares).

Parameters (`layer_params`): linear layers and the vocabulary are TP-sharded; norms (weight, plus
bias for LayerNorm) and the MoE router are replicated; routed experts are split over EP and their
matrices over TP (megatron's default expert TP = TP). Layers are split evenly over the PP x VPP
model chunks; stage p holds chunks v*PP + p (or, without VPP, a given first / last stage's
layers and the rest split evenly, megatron's num_layers_in_first/last_pipeline_stage). The input embedding is on the first stage, the final
norm, the output layer (unless tied with PP = 1) and the MTP depths on the last. Linear biases
are not counted (add_bias_linear = False); MLA's down projections are replicated, its up
projections TP-sharded.

Static bytes per parameter (Megatron-LM's convention, `precision="bf16"`): 2 (bf16 weight) + 4
(fp32 main gradient) + 12 (fp32 main weight, Adam's two moments) = 18; with the distributed
optimizer the 12 are sharded over the data-parallel ranks: 6 + 12 / (DP x CP) (experts: over
their own data-parallel size DP x CP / EP). `precision="fp32"` (no bf16 copy): 4 + 4 + 8 = 16,
or 8 + 8 / d.

Activations per layer and microbatch, in bytes (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", as in Megatron-LM's theoretical memory), with s the
sequence length over CP, b the micro batch, h hidden, a heads, t TP, f the MLP width (top-k x
expert width plus shared width for MoE layers), g = 6 for a gated MLP (SwiGLU) else 4:
  selective recompute: s*b*h*(10 + (8 + g*f/h)/t), or s*b*h*(18 + g*f/h)/t with SP;
  no recompute, fused attention (the default): the above plus the softmax statistics the fused
    kernel keeps for its backward, one fp32 value per query and head, 4*a*s*b/t;
  no recompute, unfused attention (`attention="unfused"`): the above plus the attention scores
    5*a*s*s_full*b/t (softmax output, dropout mask and output of every query-key pair);
  full recompute: 2*s*b*h (each layer's input), /t with SP.
Fused is what megatron-core runs with Transformer Engine or flash attention: the s x s scores are
recomputed block by block in the backward, never kept; Q, K, V and the output it keeps are the
8*s*b*h/t already counted. Unfused is megatron-core's local `DotProductAttention`. K and V are
counted at the query's width (Korthikanti's multi-head count), an over-estimate of
4*s*b*h*(1 - groups/heads)/t per layer under grouped-query attention.
Mamba and gated-DeltaNet layers are counted with the same per-layer formula (an approximation).
The last stage adds its fp32 logits, 4*s*b*V/t. A stage holds the activations of the
microbatches in flight: 1F1B, min(PP - p, M) microbatches on stage p; interleaved (VPP = v),
min((PP - p - 1)*2 + (v - 1)*PP + 1, M*v) chunk-microbatches of L/(PP*v) layers each.
"""

from __future__ import annotations

from dataclasses import dataclass

from accounting.flops import ModelShape
from accounting.hybrid import MAMBA_CONV_WIDTH
from accounting.layout_checks import check_layout

__all__ = ["ATTENTION", "MemoryEstimate", "ParallelLayout", "StageMemory", "memory_estimate", "stage_layers"]

RECOMPUTE = (None, "selective", "full")
# "fused": flash / TE attention, no s x s scores kept; "unfused": megatron-core's local attention.
ATTENTION = ("fused", "unfused")
PRECISIONS = {"bf16": (2, 4, 12), "fp32": (4, 4, 8)}  # weight, main gradient, optimizer bytes


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """The parallel layout and batch of one training run (megatron's names, in short)."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    seq_len: int
    num_microbatches: int | None = None  # None: enough to fill the pipeline
    sequence_parallel: bool = False
    recompute: str | None = None
    attention: str = "fused"
    distributed_optimizer: bool = False
    # Megatron's num_layers_in_first/last_pipeline_stage (uneven pipelines, without VPP only).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "dp", "micro_batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r} must be a positive int")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ValueError(f"vpp = {self.vpp} needs vpp >= 2 and pp >= 2 (None: no virtual pipeline)")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute = {self.recompute!r}: expected one of {RECOMPUTE}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention = {self.attention!r}: expected one of {ATTENTION}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"ep = {self.ep} must divide dp x cp = {self.dp * self.cp} (experts' data parallel)"
            )
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len = {self.seq_len} must be divisible by cp = {self.cp}")
        if self.cp > 1 and self.seq_len % (2 * self.cp):
            raise ValueError(
                f"seq_len = {self.seq_len} must be divisible by 2 x cp = {2 * self.cp} (megatron-core "
                "cuts it into 2 x CP chunks, two per CP rank, to balance causal attention)"
            )
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise ValueError(f"num_microbatches = {self.num_microbatches} must be at least 1")
        self._check_uneven()

    def _check_uneven(self) -> None:
        for name in ("first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} = {value!r} must be an int >= 0")
            if self.pp < 2 or self.vpp is not None:
                raise ValueError(
                    f"{name} needs pp >= 2 and no virtual pipeline (pp = {self.pp}, vpp = {self.vpp})"
                )

    @property
    def chunks(self) -> int:
        return self.vpp or 1


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's most loaded rank: parameters (expert ones apart) and bytes."""

    stage: int
    params: int
    expert_params: int
    static_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.static_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "stage": self.stage,
            "params": self.params,
            "expert_params": self.expert_params,
            "static_bytes": self.static_bytes,
            "activation_bytes": self.activation_bytes,
            "total_bytes": self.total_bytes,
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Every stage's estimate; `max_stage` is the first stage with the largest total.

    `attention` is the attention the activations assume ("fused" or "unfused", see `ATTENTION`).
    """

    stages: tuple[StageMemory, ...]
    attention: str = "fused"

    @property
    def max_stage(self) -> int:
        return max(self.stages, key=lambda s: (s.total_bytes, -s.stage)).stage

    def to_dict(self) -> dict:
        return {
            "stages": [s.to_dict() for s in self.stages],
            "max_stage": self.max_stage,
            "attention": self.attention,
        }


def _layer_kinds(shape: ModelShape) -> list[tuple[str, str]]:
    """(mixer, ffn) of each main decoder layer: mixer in attention/mla/mamba/gdn/dsa, ffn in mlp/moe/none."""
    if shape.hybrid_layers is not None:
        names = {"M": ("mamba", "none"), "G": ("gdn", "none"), "*": ("attention", "none")}
        names.update({"+": ("mla", "none"), "D": ("mla", "none"), "-": ("none", "mlp"), "E": ("none", "moe")})
        return [names[c] for c in shape.hybrid_layers.main]
    mixer = "mla" if shape.multi_latent_attention else "attention"
    linear = [0] * shape.num_layers
    if shape.linear_layers:
        from accounting.linear_attention import linear_layer_pattern

        linear = list(linear_layer_pattern(shape.linear_attention_freq, shape.num_layers))
    moe = shape.moe_layer_pattern
    return [("gdn" if linear[i] else mixer, "moe" if moe[i] else "mlp") for i in range(shape.num_layers)]


def _uneven_counts(num_layers: int, layout: ParallelLayout) -> list[int] | None:
    """Layers per stage with a given first and/or last stage, the rest split evenly (megatron's rule)."""
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is None and last is None:
        return None
    middle = layout.pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle and rest % middle) or (not middle and rest):
        raise ValueError(
            f"num_layers = {num_layers} with first_stage_layers = {first}, last_stage_layers = {last}: "
            f"the other {rest} layers do not split evenly over {middle} stages"
        )
    each = rest // middle if middle else 0
    counts = [each] * layout.pp
    counts[0] = each if first is None else first
    counts[-1] = each if last is None else last
    return counts


def stage_layers(num_layers: int, layout: ParallelLayout) -> list[list[int]]:
    """The main decoder layers of each stage: chunk v*PP + p of PP*VPP equal chunks is on stage p
    (or the uneven split of `first_stage_layers` / `last_stage_layers`)."""
    counts = _uneven_counts(num_layers, layout)
    if counts is not None:
        starts = [sum(counts[:p]) for p in range(layout.pp)]
        return [list(range(start, start + n)) for start, n in zip(starts, counts, strict=True)]
    chunks = layout.pp * layout.chunks
    if num_layers % chunks:
        raise ValueError(f"num_layers = {num_layers} is not divisible by pp x vpp = {chunks} model chunks")
    per = num_layers // chunks
    out: list[list[int]] = [[] for _ in range(layout.pp)]
    for chunk in range(chunks):
        out[chunk % layout.pp].extend(range(chunk * per, (chunk + 1) * per))
    return out


def _norm(shape: ModelShape, normalization: str) -> int:
    return 2 * shape.hidden_size if normalization == "LayerNorm" else shape.hidden_size


def _mixer_params(shape: ModelShape, mixer: str, t: int, norm: int) -> int:
    """One layer's sequence mixer on one TP rank, its pre-norm included."""
    h = shape.hidden_size
    if mixer == "none":
        return 0
    if mixer == "attention":
        q, kv = shape.kv_channels * shape.num_attention_heads, shape.kv_channels * shape.num_query_groups
        gate = q if shape.attention_output_gate else 0
        return norm + (h * (q + 2 * kv + gate) + q * h) // t
    if mixer == "mla":
        n, rope = shape.num_attention_heads, shape.qk_pos_emb_head_dim
        qk = shape.qk_head_dim + rope
        down = h * (shape.kv_lora_rank + rope) + (0 if shape.q_lora_rank is None else h * shape.q_lora_rank)
        query_up = n * qk * (h if shape.q_lora_rank is None else shape.q_lora_rank)
        up = (
            query_up
            + shape.kv_lora_rank * n * (shape.qk_head_dim + shape.v_head_dim)
            + n * shape.v_head_dim * h
        )
        latent_norms = shape.kv_lora_rank + (shape.q_lora_rank or 0)
        return norm + down + latent_norms + up // t
    if mixer == "mamba":
        heads, d = shape.mamba_num_heads, shape.mamba_num_heads * shape.mamba_head_dim
        bc = 2 * shape.mamba_num_groups * shape.mamba_state_dim
        sharded = h * (2 * d + bc + heads) + (d + bc) * (MAMBA_CONV_WIDTH + 1) + 3 * heads + d + d * h
        return norm + sharded // t
    qk = shape.linear_num_key_heads * shape.linear_key_head_dim
    v, vh = shape.linear_num_value_heads * shape.linear_value_head_dim, shape.linear_num_value_heads
    sharded = h * (2 * qk + 2 * v + 2 * vh) + (2 * qk + v) * shape.linear_conv_kernel_dim + 2 * vh + v * h
    return norm + sharded // t + shape.linear_value_head_dim


def _ffn_params(shape: ModelShape, ffn: str, layout: ParallelLayout, norm: int) -> tuple[int, int]:
    """One layer's MLP or MoE block on one rank, pre-norm included: (non-expert, routed-expert) params."""
    h, t, mats = shape.hidden_size, layout.tp, 3 if shape.gated_linear_unit else 2
    if ffn == "none":
        return 0, 0
    if ffn == "mlp":
        return norm + mats * h * shape.ffn_hidden_size // t, 0
    if shape.num_moe_experts % layout.ep:
        raise ValueError(f"ep = {layout.ep} must divide num_moe_experts = {shape.num_moe_experts}")
    shared = mats * h * (shape.moe_shared_expert_intermediate_size or 0) // t
    width = shape.moe_latent_size or h
    experts = shape.num_moe_experts // layout.ep * mats * width * shape.moe_ffn_hidden_size // t
    latent = 2 * h * shape.moe_latent_size // t if shape.moe_latent_size else 0
    return norm + h * shape.num_moe_experts + shared + latent, experts


def _stage_params(shape: ModelShape, layout: ParallelLayout, stage: int, normalization: str, tied: bool):
    """(non-expert, expert) parameters on one rank of `stage`."""
    kinds, norm = _layer_kinds(shape), _norm(shape, normalization)
    h, t = shape.hidden_size, layout.tp
    dense = expert = 0
    layers = list(stage_layers(shape.num_layers, layout)[stage])
    last = stage == layout.pp - 1
    if last:  # MTP depths repeat the last layer's kind, plus 3 norms and the 2h -> h projection
        layers += [shape.num_layers - 1] * shape.mtp_num_layers
        dense += shape.mtp_num_layers * (3 * norm + 2 * h * h // t)
        dense += norm + (0 if tied and layout.pp == 1 else shape.vocab_size * h // t)
    if stage == 0:
        dense += shape.vocab_size * h // t
    for layer in layers:
        mixer, ffn = kinds[layer]
        ffn_dense, ffn_expert = _ffn_params(shape, ffn, layout, norm)
        dense += _mixer_params(shape, mixer, t, norm) + ffn_dense
        expert += ffn_expert
    return dense, expert


def _static_bytes(dense: int, expert: int, layout: ParallelLayout, precision: str) -> int:
    """Weights, main gradients and optimizer state (sharded over data parallel with the distributed optimizer)."""
    weight, grad, optim = PRECISIONS[precision]
    if not layout.distributed_optimizer:
        return (weight + grad + optim) * (dense + expert)
    d, d_expert = layout.dp * layout.cp, layout.dp * layout.cp // layout.ep
    return (weight + grad) * (dense + expert) + -(-optim * dense // d) + -(-optim * expert // d_expert)


def _layer_activation_bytes(shape: ModelShape, layout: ParallelLayout, ffn_width: int) -> int:
    """Bytes one layer keeps for one microbatch on one rank (the module docstring's formula)."""
    s, b, h, t = layout.seq_len // layout.cp, layout.micro_batch_size, shape.hidden_size, layout.tp
    g = 6 if shape.gated_linear_unit else 4
    if layout.recompute == "full":
        return 2 * s * b * h // (t if layout.sequence_parallel else 1)
    if layout.sequence_parallel:
        linear = s * b * (18 * h + g * ffn_width) // t
    else:
        linear = s * b * (10 * h + (8 * h + g * ffn_width) // t)
    if layout.recompute is None:
        if layout.attention == "unfused":
            linear += 5 * shape.num_attention_heads * s * layout.seq_len * b // t
        else:
            linear += 4 * shape.num_attention_heads * s * b // t
    return linear


def _ffn_width(shape: ModelShape, ffn: str) -> int:
    if ffn == "moe":
        return shape.moe_router_topk * shape.moe_ffn_hidden_size + (
            shape.moe_shared_expert_intermediate_size or 0
        )
    return shape.ffn_hidden_size if ffn == "mlp" else 0


def _in_flight(layout: ParallelLayout, stage: int) -> int:
    """Microbatches (1F1B) or chunk-microbatches (interleaved) whose activations a stage holds at its peak."""
    m = layout.num_microbatches
    if layout.vpp is None:
        fill = layout.pp - stage
        return fill if m is None else min(fill, m)
    fill = (layout.pp - stage - 1) * 2 + (layout.vpp - 1) * layout.pp + 1
    return fill if m is None else min(fill, m * layout.vpp)


def _stage_activations(shape: ModelShape, layout: ParallelLayout, stage: int) -> int:
    kinds = _layer_kinds(shape)
    layers = stage_layers(shape.num_layers, layout)[stage]
    per_layer = [_layer_activation_bytes(shape, layout, _ffn_width(shape, kinds[i][1])) for i in layers]
    # Layers per chunk-microbatch: the stage's layers over its chunks (1 chunk without VPP).
    per_chunk = sum(per_layer) // layout.chunks
    total = _in_flight(layout, stage) * per_chunk
    if stage == layout.pp - 1:
        s, b = layout.seq_len // layout.cp, layout.micro_batch_size
        last = _layer_activation_bytes(shape, layout, _ffn_width(shape, kinds[-1][1]))
        total += shape.mtp_num_layers * last + 4 * s * b * shape.vocab_size // layout.tp
    return total


def memory_estimate(
    shape: ModelShape,
    parallel: ParallelLayout,
    *,
    precision: str = "bf16",
    normalization: str = "RMSNorm",
    tied_embeddings: bool = False,
) -> MemoryEstimate:
    """Per pipeline stage: parameters, static and activation bytes of its most loaded rank.

    `normalization` ("RMSNorm" or "LayerNorm", which has a bias) sets the norms' parameters;
    `tied_embeddings` shares the output layer with the embedding (one copy when PP = 1).
    """
    if not isinstance(shape, ModelShape):
        raise ValueError(f"memory_estimate: shape must be a ModelShape, got {type(shape).__name__}")
    if not isinstance(parallel, ParallelLayout):
        raise ValueError(f"memory_estimate: parallel must be a ParallelLayout, got {type(parallel).__name__}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision = {precision!r}: expected one of {sorted(PRECISIONS)}")
    if normalization not in ("RMSNorm", "LayerNorm"):
        raise ValueError(f"normalization = {normalization!r}: expected 'RMSNorm' or 'LayerNorm'")
    check_layout(shape, parallel, _layer_kinds(shape))
    stages = []
    for stage in range(parallel.pp):
        dense, expert = _stage_params(shape, parallel, stage, normalization, tied_embeddings)
        stages.append(
            StageMemory(
                stage=stage,
                params=dense + expert,
                expert_params=expert,
                static_bytes=_static_bytes(dense, expert, parallel, precision),
                activation_bytes=_stage_activations(shape, parallel, stage),
            )
        )
    return MemoryEstimate(tuple(stages), attention=parallel.attention)
