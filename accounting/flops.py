"""Training FLOPs of a GPT-style decoder from its shape and the batch's sequence statistics.

Conventions (those of Megatron-LM's `num_floating_point_operations`, which dense configurations
reproduce exactly): 2 FLOPs per multiply-add; backward = 2x forward, so every term is 3x its
forward cost; causal attention counts half of the s x s score and value products (s^2/2 pairs per
document, i.e. the exact s(s+1)/2 minus half the diagonal); `causal=False` counts all s^2.
A sliding window removes, per document, exactly the pairs outside it (see `accounting.seqlens`);
DeepSeek sparse attention's top-k cap is counted the same way, as a left window of k - 1 keys (see
`accounting.sparse_attention` and `ModelShape.stats_window`).

Only matrix multiplies and the sequence mixers' convolutions and scans are counted: norms,
activations, softmax, RoPE and residual adds are not, with one exception kept to match
Megatron-LM: the `mtp` term counts 3h per token for each MTP depth's three norms. The MoE router's
GEMM (hidden x experts per MoE layer and token) is its own term, `moe_router`; Megatron-LM and
Megatron-Bridge do not count it, nor Mamba-2's depthwise conv1d (counted here in `mamba`).

Model FLOPs (`total`, the MFU numerator) use real tokens and real lengths. Hardware FLOPs
(`hardware_total`) use the padded tokens and padded lengths the kernels execute, plus the forward
pass that activation recomputation repeats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from accounting.adapters import LoraAdapter, adapter_macs_per_token
from accounting.hybrid import HybridLayers, mamba_forward_flops_per_token, parse_hybrid_pattern
from accounting.linear_attention import GDN_VARIANTS, gdn_forward_flops_per_token, linear_layer_pattern
from accounting.seqlen_fields import describe_malformed
from accounting.sparse_attention import (
    DSA_VARIANT,
    absorbed_pair_macs,
    indexer_pair_macs,
    indexer_projection_macs,
    loss_target_pair_macs,
    topk_window,
)
from accounting.window import normalize_window

if TYPE_CHECKING:  # the statistics' module imports torch: loaded where a tensor first appears
    from accounting.seqlens import SeqlenStats

__all__ = ["TERMS", "FlopsBreakdown", "ModelShape", "flops_from_sums", "training_flops"]

# Term names of `FlopsBreakdown.terms`. The MTP layers' own attention and MLP are counted in the
# attention and mlp/moe terms (as Megatron-LM does); `mtp` holds their norms and eh projection;
# `moe_router` the router's GEMM (hidden x experts) of every MoE layer, MTP ones included.
# `mla_projections` holds multi-latent attention's down/up projections (its core attention is in
# `core_attention`); `mamba` the Mamba-2 mixers' projections and conv, `mamba_scan` their scan
# (hybrid patterns); `gdn` / `gdn_scan` the same for gated DeltaNet layers; `adapter` the trainable adapter's GEMMs (only when an adapter is given).
# DeepSeek sparse attention layers count their MLA projections in `mla_projections` and their
# top-k attention in `core_attention`; `dsa_indexer` holds the indexer's projections,
# `dsa_indexer_scores` its scores over all causal pairs, `dsa_indexer_loss` the target scores of
# its KL loss (only when that loss is on).
TERMS = (
    "attention_projections",
    "mla_projections",
    "core_attention",
    "dsa_indexer",
    "dsa_indexer_scores",
    "dsa_indexer_loss",
    "mamba",
    "mamba_scan",
    "gdn",
    "gdn_scan",
    "mlp",
    "moe",
    "moe_router",
    "mtp",
    "logits",
    "adapter",
)
RECOMPUTE = (None, "full", "selective")
# Terms that keep 3x their forward under `frozen_base`: core attention has no weights, the adapter trains.
_WEIGHTLESS = ("core_attention", "mamba_scan", "gdn_scan", "adapter")


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} = {value!r} must be a positive int")
    return value


def _non_negative(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} = {value!r} must be an int >= 0")
    return value


# MLATransformerConfig's defaults for kv_lora_rank, qk_head_dim, qk_pos_emb_head_dim, v_head_dim.
_MLA_DEFAULTS = (512, 128, 64, 128)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """A GPT-style decoder; field names and defaults follow megatron-core's `TransformerConfig`.

    Defaults are resolved on construction: `ffn_hidden_size` 4*hidden, `num_query_groups` heads,
    `kv_channels` hidden/heads, `moe_ffn_hidden_size` ffn, `mtp_num_layers` 0; `moe_layer_freq`
    becomes a tuple when given as a list; `window_size` becomes `(left, right)` or None.
    `vocab_size` is the padded vocabulary the output layer multiplies by.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    kv_channels: int | None = None
    gated_linear_unit: bool = False
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_latent_size: int | None = None
    mtp_num_layers: int | None = None
    window_size: int | tuple[int, int] | None = None
    window_attn_skip_freq: int | tuple[int, ...] | None = None
    attention_output_gate: bool = False
    causal: bool = True
    # Multi-latent attention (megatron-core's MLATransformerConfig; DeepSeek-V2/V3, Kimi K2). When
    # on, these replace num_query_groups/kv_channels; None takes MLATransformerConfig's default,
    # except q_lora_rank, where None means a direct query projection (no low-rank query).
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int | None = None
    qk_pos_emb_head_dim: int | None = None
    v_head_dim: int | None = None
    # Hybrid models (Nemotron-H): the layer pattern in megatron-core's alphabet (see
    # accounting.hybrid); num_layers must equal its main decoder's layers, and its MTP depths
    # set mtp_num_layers. Mamba-2 mixers: mamba_num_heads None means megatron's expand = 2
    # (inner width 2 * hidden_size, heads = that / mamba_head_dim).
    hybrid_pattern: str | None = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    # Gated DeltaNet linear attention (Qwen3-Next): experimental_attention_variant "gated_delta_net"
    # (or "gdn", its newer name) with linear_attention_freq choosing the linear layers; in a
    # hybrid_pattern the `G` layers use it. Defaults are TransformerConfig's.
    experimental_attention_variant: str | None = None
    linear_attention_freq: int | tuple[int, ...] | None = None
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_conv_kernel_dim: int = 4
    # DeepSeek sparse attention (DeepSeek-V3.2): experimental_attention_variant "dsa" on MLA makes
    # every layer (MTP included) a DSA layer; in a hybrid_pattern the `D` layers are. The indexer
    # has dsa_indexer_n_heads heads of dsa_indexer_head_dim and keeps dsa_indexer_topk keys per
    # query; a dsa_indexer_loss_coeff > 0 trains it with its KL loss (over the top-k keys only
    # with dsa_indexer_use_sparse_loss). See accounting.sparse_attention.
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None
    dsa_indexer_loss_coeff: float | None = None
    dsa_indexer_use_sparse_loss: bool = False

    def __post_init__(self) -> None:
        def resolve(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        _positive("num_layers", self.num_layers)
        _positive("hidden_size", self.hidden_size)
        _positive("num_attention_heads", self.num_attention_heads)
        _positive("vocab_size", self.vocab_size)
        if isinstance(self.hybrid_pattern, str):
            # '|' marks where megatron cuts the pipeline: a layout, not the model. Two layouts of
            # one hybrid are one shape (the cuts never changed a count, only equality).
            resolve("hybrid_pattern", self.hybrid_pattern.replace("|", ""))
        resolve(
            "ffn_hidden_size", 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size
        )
        _positive("ffn_hidden_size", self.ffn_hidden_size)
        if self.num_query_groups is None:
            resolve("num_query_groups", self.num_attention_heads)
        _positive("num_query_groups", self.num_query_groups)
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups = {self.num_query_groups} must divide "
                f"num_attention_heads = {self.num_attention_heads}"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"kv_channels is not given and hidden_size = {self.hidden_size} is not divisible by "
                    f"num_attention_heads = {self.num_attention_heads}"
                )
            resolve("kv_channels", self.hidden_size // self.num_attention_heads)
        _positive("kv_channels", self.kv_channels)
        for flag in ("gated_linear_unit", "attention_output_gate", "causal"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} = {getattr(self, flag)!r} must be a bool")
        resolve("mtp_num_layers", 0 if self.mtp_num_layers is None else self.mtp_num_layers)
        _non_negative("mtp_num_layers", self.mtp_num_layers)
        resolve("window_size", normalize_window(self.window_size))
        self._check_window_layers()
        self._check_moe()
        self._check_mla()
        self._check_hybrid()
        self._check_linear_attention()
        self._check_sparse_attention()

    def _check_linear_attention(self) -> None:
        variant = self.experimental_attention_variant
        if variant in (None, "", "none"):
            object.__setattr__(self, "experimental_attention_variant", None)
            if self.linear_attention_freq is not None:
                raise ValueError(
                    f"linear_attention_freq = {self.linear_attention_freq!r} needs experimental_attention_variant"
                )
            if self.hybrid_pattern is not None and self.linear_layers:
                self._check_gdn_fields()
            return
        if variant == DSA_VARIANT:
            if self.linear_attention_freq is not None:
                raise ValueError(
                    f"linear_attention_freq = {self.linear_attention_freq!r} with experimental_attention_variant "
                    "= 'dsa': megatron-core ignores it (every layer is DSA); leave it None"
                )
            if self.hybrid_pattern is not None and self.linear_layers:
                self._check_gdn_fields()
            return
        if variant not in GDN_VARIANTS:
            raise ValueError(
                f"experimental_attention_variant = {variant!r} is not modelled "
                f"(known: {', '.join((*GDN_VARIANTS, DSA_VARIANT))})"
            )
        self._check_gdn_fields()
        freq = self.linear_attention_freq
        if self.hybrid_pattern is not None:
            return  # the pattern's `G` layers are the linear ones
        if freq is None:
            raise ValueError(f"experimental_attention_variant = {variant!r} needs linear_attention_freq")
        if isinstance(freq, (list, tuple)):
            freq = tuple(freq)
            object.__setattr__(self, "linear_attention_freq", freq)
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, float) for v in freq):
                raise ValueError(
                    f"linear_attention_freq = {list(freq)!r} must list one 0 or 1 per layer ({self.num_layers} layers)"
                )
        else:
            _positive("linear_attention_freq", freq)
        if self.window_size is not None or self.multi_latent_attention:
            raise ValueError("experimental_attention_variant with window_size or MLA is not modelled")

    def _check_gdn_fields(self) -> None:
        for name in ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads"):
            _positive(name, getattr(self, name))
        for name in ("linear_num_value_heads", "linear_conv_kernel_dim"):
            _positive(name, getattr(self, name))

    def _check_sparse_attention(self) -> None:
        names = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")
        if not isinstance(self.dsa_indexer_use_sparse_loss, bool):
            raise ValueError(
                f"dsa_indexer_use_sparse_loss = {self.dsa_indexer_use_sparse_loss!r} must be a bool"
            )
        coeff = self.dsa_indexer_loss_coeff
        if coeff is not None and (
            isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0
        ):
            raise ValueError(f"dsa_indexer_loss_coeff = {coeff!r} must be a number >= 0 or None")
        if not self.dsa_layers:
            return  # no DSA layer: the indexer fields do not matter
        for name in names:
            if getattr(self, name) is None:
                raise ValueError(f"{name} is None but the model has DeepSeek sparse attention layers")
            _positive(name, getattr(self, name))
        if not self.multi_latent_attention:
            raise ValueError(
                "DeepSeek sparse attention needs multi_latent_attention = True (megatron-core: "
                "'Currently only MLA supports sparse attention')"
            )
        if self.window_size is not None:
            raise ValueError(
                f"window_size = {self.window_size!r} with DeepSeek sparse attention is not modelled"
            )
        if not self.causal:
            raise ValueError(
                "causal = False with DeepSeek sparse attention is not modelled (its mask is causal)"
            )

    @cached_property
    def hybrid_layers(self) -> HybridLayers | None:
        """The hybrid pattern's layers, parsed once per shape (a step asks for them several times)."""
        return None if self.hybrid_pattern is None else parse_hybrid_pattern(self.hybrid_pattern)

    @property
    def dsa_layers(self) -> int:
        """DeepSeek-sparse-attention layers, MTP depths included (MTP takes the last layer's kind)."""
        if self.hybrid_layers is not None:
            return self.hybrid_layers.counts["dsa"]
        if self.experimental_attention_variant == DSA_VARIANT:
            return self.num_layers + self.mtp_num_layers
        return 0

    @property
    def dsa_indexer_loss(self) -> bool:
        """Whether the indexer trains with its KL loss (megatron: `dsa_indexer_loss_coeff > 0`)."""
        return bool(self.dsa_indexer_loss_coeff) and self.dsa_indexer_loss_coeff > 0

    @property
    def stats_window(self) -> tuple[int, int] | None:
        """The window the sequence statistics must carry (`seqlen_stats(..., window_size=...)`).

        `window_size` for sliding-window attention; for DeepSeek sparse attention the top-k cap as
        a left window of `dsa_indexer_topk - 1` keys (its pairs beyond are what the cap removes).
        """
        if self.dsa_layers:
            return topk_window(self.dsa_indexer_topk)
        return self.window_size

    @property
    def linear_layers(self) -> int:
        """Gated-DeltaNet layers, MTP depths included (an MTP layer takes the last layer's kind)."""
        if self.hybrid_layers is not None:
            return self.hybrid_layers.counts["gdn"]
        if self.experimental_attention_variant not in GDN_VARIANTS:
            return 0
        pattern = linear_layer_pattern(self.linear_attention_freq, self.num_layers)
        return sum(pattern) + (self.mtp_num_layers if pattern[-1] else 0)

    def _check_hybrid(self) -> None:
        layers = self.hybrid_layers
        if layers is None:
            return  # the mamba_* fields only matter for a hybrid pattern
        if len(layers.main) != self.num_layers:
            raise ValueError(
                f"hybrid_pattern = {self.hybrid_pattern!r} has {len(layers.main)} main layers but "
                f"num_layers = {self.num_layers}"
            )
        if self.mtp_num_layers not in (0, layers.mtp_depths):
            raise ValueError(
                f"mtp_num_layers = {self.mtp_num_layers} but hybrid_pattern has {layers.mtp_depths} MTP depths"
            )
        object.__setattr__(self, "mtp_num_layers", layers.mtp_depths)
        if self.window_size:
            raise ValueError(f"window_size = {self.window_size!r} with a hybrid_pattern is not modelled")
        latent = layers.counts["mla"] + layers.counts["dsa"]
        if latent and not self.multi_latent_attention:
            raise ValueError(
                f"hybrid_pattern = {self.hybrid_pattern!r} has '+' MLA or 'D' DSA layers but "
                "multi_latent_attention is False (they need an MLATransformerConfig's fields)"
            )
        if layers.counts["attention"] and self.multi_latent_attention:
            raise ValueError(
                f"hybrid_pattern = {self.hybrid_pattern!r} has '*' layers with multi_latent_attention = True: "
                "megatron builds standard attention for '*' (use '+' for MLA); that mix is not modelled"
            )
        if layers.counts["moe"] and self.num_moe_experts is None:
            raise ValueError(
                f"hybrid_pattern = {self.hybrid_pattern!r} has MoE layers but num_moe_experts is None"
            )
        if not layers.counts["mamba"]:
            return  # no Mamba layer: its fields do not matter
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            _positive(name, getattr(self, name))
        if self.mamba_num_heads is None:
            inner = 2 * self.hidden_size
            if inner % self.mamba_head_dim:
                raise ValueError(
                    f"mamba_num_heads is not given and 2 * hidden_size = {inner} is not divisible by "
                    f"mamba_head_dim = {self.mamba_head_dim}"
                )
            object.__setattr__(self, "mamba_num_heads", inner // self.mamba_head_dim)
        _positive("mamba_num_heads", self.mamba_num_heads)
        if self.mamba_num_heads % self.mamba_num_groups:
            raise ValueError(
                f"mamba_num_groups = {self.mamba_num_groups} must divide mamba_num_heads = {self.mamba_num_heads}"
            )

    def _check_mla(self) -> None:
        names = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        if not isinstance(self.multi_latent_attention, bool):
            raise ValueError(f"multi_latent_attention = {self.multi_latent_attention!r} must be a bool")
        if not self.multi_latent_attention:
            for name in ("q_lora_rank", *names):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} = {getattr(self, name)!r} is set but multi_latent_attention is False"
                    )
            return
        for name, default in zip(names, _MLA_DEFAULTS, strict=True):
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)
            _positive(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive("q_lora_rank", self.q_lora_rank)
        if self.attention_output_gate:
            raise ValueError(
                "attention_output_gate = True with multi_latent_attention: MLA has no output gate"
            )

    def _check_window_layers(self) -> None:
        skip = self.window_attn_skip_freq
        if skip is None:
            return
        if isinstance(skip, (list, tuple)):
            skip = tuple(skip)
            object.__setattr__(self, "window_attn_skip_freq", skip)
            if len(skip) != self.num_layers or any(v not in (0, 1) or isinstance(v, float) for v in skip):
                raise ValueError(
                    f"window_attn_skip_freq = {list(skip)!r} must list one 0 or 1 per layer ({self.num_layers} layers)"
                )
        else:
            _positive("window_attn_skip_freq", skip)

    def _check_moe(self) -> None:
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        freq = self.moe_layer_freq
        if isinstance(freq, (list, tuple)):
            freq = tuple(freq)
            object.__setattr__(self, "moe_layer_freq", freq)
        if self.num_moe_experts is None:
            return
        _positive("num_moe_experts", self.num_moe_experts)
        _positive("moe_router_topk", self.moe_router_topk)
        if self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"moe_router_topk = {self.moe_router_topk} exceeds num_moe_experts = {self.num_moe_experts}"
            )
        _positive("moe_ffn_hidden_size", self.moe_ffn_hidden_size)
        if self.moe_shared_expert_intermediate_size is not None:
            _non_negative("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
        if self.moe_latent_size is not None:
            _positive("moe_latent_size", self.moe_latent_size)
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or any(v not in (0, 1) or isinstance(v, float) for v in freq):
                raise ValueError(
                    f"moe_layer_freq = {list(freq)!r} must list one 0 or 1 per layer ({self.num_layers} layers)"
                )
        else:
            _positive("moe_layer_freq", freq)

    @property
    def moe_layer_pattern(self) -> tuple[int, ...]:
        """1 for each MoE layer, 0 for each dense-MLP layer (Megatron: layer i is MoE if i % freq == 0)."""
        if self.num_moe_experts is None:
            return (0,) * self.num_layers
        if isinstance(self.moe_layer_freq, tuple):
            return self.moe_layer_freq
        return tuple(1 if i % self.moe_layer_freq == 0 else 0 for i in range(self.num_layers))

    @property
    def window_layer_pattern(self) -> tuple[int, ...]:
        """1 for each sliding-window layer, 0 for each full-attention layer.

        megatron-core's `is_layer_window_attention`: with an int N, 1-based layer l is windowed
        unless l % N == 0; a list gives 1 (window) or 0 (full) per layer.
        """
        if self.window_size is None:
            return (0,) * self.num_layers
        skip = self.window_attn_skip_freq
        if skip is None:
            return (1,) * self.num_layers
        if isinstance(skip, tuple):
            return skip
        return tuple(1 if layer % skip != 0 else 0 for layer in range(1, self.num_layers + 1))

    @classmethod
    def from_megatron(
        cls, config: Any, vocab_size: int, *, hybrid_pattern: str | None = None, causal: bool = True
    ) -> ModelShape:
        """Builds a shape from a megatron-core `TransformerConfig` / `MLATransformerConfig`.

        Duck-typed: nothing is imported from megatron. `vocab_size` must be the padded
        vocabulary. A field of a release newer than those the kit knows (set to a non-default
        value), or a feature whose FLOPs this module does not model, raises ValueError naming the
        field rather than returning a silently wrong count (see `accounting.megatron_config`).
        A hybrid model (`is_hybrid_model`) takes its layer pattern as `hybrid_pattern`.
        """
        from accounting.megatron_config import shape_kwargs

        return cls(**shape_kwargs(config, hybrid_pattern), vocab_size=vocab_size, causal=causal)

    @classmethod
    def from_hf_config(cls, source: Any, **overrides: Any) -> ModelShape:
        """Builds a shape from a Hugging Face `config.json` (path or dict); see `accounting.hf_config`.

        An unsupported `model_type` or a field that may change the FLOPs raises ValueError naming it.
        """
        from accounting.hf_config import hf_shape_kwargs

        return cls(**hf_shape_kwargs(source, **overrides))


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward + backward FLOPs of one global batch, as exact Python ints."""

    total: int
    hardware_total: int
    terms: dict[str, int]
    hardware_terms: dict[str, int] = field(default_factory=dict)
    recompute: str | None = None


@dataclass(frozen=True)
class _Layers:
    """How many layers of each kind one token passes through, MTP depths included."""

    attention: int  # softmax attention (standard, MLA or DSA): attention or MLA projections
    dense: int  # dense-MLP layers
    moe: int  # MoE layers
    mamba: int  # Mamba-2 mixers (hybrid patterns)
    gdn: int  # gated DeltaNet mixers
    dsa: int  # DeepSeek sparse attention layers (their indexers)
    mtp: int  # MTP depths


def _layers(shape: ModelShape) -> _Layers:
    """The layer counts of `shape`: from its hybrid pattern, or from its per-layer frequencies."""
    mtp, linear, dsa = shape.mtp_num_layers, shape.linear_layers, shape.dsa_layers
    if shape.hybrid_layers is not None:
        counts = shape.hybrid_layers.counts
        attention = counts["attention"] + counts["mla"] + counts["dsa"]
        return _Layers(attention, counts["mlp"], counts["moe"], counts["mamba"], linear, dsa, mtp)
    pattern = shape.moe_layer_pattern
    moe = sum(pattern)
    dense = shape.num_layers - moe
    # MTP layers repeat the last decoder layer's kind (Megatron-LM's convention).
    if pattern[-1]:
        moe += mtp
    else:
        dense += mtp
    # Without a pattern every non-linear layer is attention (all DSA ones when DSA is on).
    return _Layers(shape.num_layers + mtp - linear, dense, moe, 0, linear, dsa, mtp)


def _attention_projections(shape: ModelShape, layers: _Layers) -> int:
    """QKV (plus the output gate) and output projections of standard attention layers."""
    if shape.multi_latent_attention:
        return 0
    h = shape.hidden_size
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    gate = q if shape.attention_output_gate else 0
    return 2 * layers.attention * (h * (q + 2 * kv + gate) + q * h)


def _mla_projections(shape: ModelShape, layers: _Layers) -> int:
    """Multi-latent attention's projections, on MLA and DSA layers alike."""
    if not shape.multi_latent_attention:
        return 0
    return 2 * layers.attention * _mla_projection_macs(shape)


def _dsa_indexer(shape: ModelShape, layers: _Layers) -> int:
    """The DSA indexer's projections."""
    if not layers.dsa:
        return 0
    heads, head_dim = shape.dsa_indexer_n_heads, shape.dsa_indexer_head_dim
    return 2 * layers.dsa * indexer_projection_macs(shape.hidden_size, shape.q_lora_rank, heads, head_dim)


def _mamba_mixer(shape: ModelShape) -> tuple[int, int]:
    """One Mamba-2 mixer's (weights, scan) forward FLOPs per token."""
    return mamba_forward_flops_per_token(
        shape.hidden_size,
        shape.mamba_num_heads,
        shape.mamba_head_dim,
        shape.mamba_num_groups,
        shape.mamba_state_dim,
    )


def _mamba(shape: ModelShape, layers: _Layers) -> int:
    """Mamba-2 mixers' projections and conv."""
    return layers.mamba * _mamba_mixer(shape)[0] if layers.mamba else 0


def _mamba_scan(shape: ModelShape, layers: _Layers) -> int:
    """Mamba-2 mixers' selective scan."""
    return layers.mamba * _mamba_mixer(shape)[1] if layers.mamba else 0


def _gdn_mixer(shape: ModelShape) -> tuple[int, int]:
    """One gated-DeltaNet mixer's (weights, recurrence) forward FLOPs per token."""
    return gdn_forward_flops_per_token(
        shape.hidden_size,
        shape.linear_key_head_dim,
        shape.linear_value_head_dim,
        shape.linear_num_key_heads,
        shape.linear_num_value_heads,
        shape.linear_conv_kernel_dim,
    )


def _gdn(shape: ModelShape, layers: _Layers) -> int:
    """Gated-DeltaNet mixers' projections and conv."""
    return layers.gdn * _gdn_mixer(shape)[0] if layers.gdn else 0


def _gdn_scan(shape: ModelShape, layers: _Layers) -> int:
    """Gated-DeltaNet mixers' recurrence."""
    return layers.gdn * _gdn_mixer(shape)[1] if layers.gdn else 0


def _glu(shape: ModelShape) -> int:
    """GEMMs per MLP (up, gate if gated, down): 3 with a gated linear unit, else 2."""
    return 3 if shape.gated_linear_unit else 2


def _mlp(shape: ModelShape, layers: _Layers) -> int:
    """Dense MLPs."""
    return 2 * layers.dense * shape.hidden_size * shape.ffn_hidden_size * _glu(shape)


def _moe(shape: ModelShape, layers: _Layers) -> int:
    """MoE layers' routed experts (top-k per token) and shared experts."""
    if shape.num_moe_experts is None:
        return 0
    h, glu = shape.hidden_size, _glu(shape)
    topk, moe_ffn = shape.moe_router_topk, shape.moe_ffn_hidden_size
    shared = shape.moe_shared_expert_intermediate_size or 0
    if shape.moe_latent_size is None:
        routed = h * moe_ffn * topk * glu
    else:  # experts run in the latent space, plus the down and up projections to it
        routed = shape.moe_latent_size * moe_ffn * topk * glu + 2 * h * shape.moe_latent_size
    return 2 * layers.moe * (routed + h * shared * glu)


def _moe_router(shape: ModelShape, layers: _Layers) -> int:
    """The MoE router's GEMM (hidden x experts) on every MoE layer, MTP ones included."""
    if shape.num_moe_experts is None:
        return 0
    return 2 * layers.moe * shape.hidden_size * shape.num_moe_experts


def _mtp(shape: ModelShape, layers: _Layers) -> int:
    """MTP depths' three norms and eh projection (their attention and MLP are counted above)."""
    h = shape.hidden_size
    return 2 * layers.mtp * (3 * h + 2 * h * h)


def _logits(shape: ModelShape, layers: _Layers) -> int:
    """The output layer, once for the main decoder and once per MTP depth."""
    return 2 * shape.hidden_size * shape.vocab_size * (layers.mtp + 1)


# The terms linear in the token count: name -> forward FLOPs per token. A new such term is a
# function here and a row in this table (and its name in TERMS).
_PER_TOKEN_TERMS = {
    "attention_projections": _attention_projections,
    "mla_projections": _mla_projections,
    "dsa_indexer": _dsa_indexer,
    "mamba": _mamba,
    "mamba_scan": _mamba_scan,
    "gdn": _gdn,
    "gdn_scan": _gdn_scan,
    "mlp": _mlp,
    "moe": _moe,
    "moe_router": _moe_router,
    "mtp": _mtp,
    "logits": _logits,
}


def _per_token_forward(shape: ModelShape) -> dict[str, int]:
    """Forward FLOPs per token of every term that is linear in the token count."""
    layers = _layers(shape)
    return {name: term(shape, layers) for name, term in _PER_TOKEN_TERMS.items()}


def _mla_projection_macs(shape: ModelShape) -> int:
    """Multiply-adds per token of one MLA layer's projections (DeepSeek-V2 §2.1, megatron's MLA).

    Query: h -> q_lora_rank -> heads x (qk + rope), or h -> heads x (qk + rope) directly; keys
    and values: h -> kv_lora_rank + rope (the shared rope key), kv_lora_rank -> heads x (qk + v);
    output: heads x v -> h. Norms and RoPE are not GEMMs and are not counted.
    """
    h, n = shape.hidden_size, shape.num_attention_heads
    qk = shape.qk_head_dim + shape.qk_pos_emb_head_dim
    query = h * n * qk if shape.q_lora_rank is None else h * shape.q_lora_rank + shape.q_lora_rank * n * qk
    kv = h * (shape.kv_lora_rank + shape.qk_pos_emb_head_dim) + shape.kv_lora_rank * n * (
        shape.qk_head_dim + shape.v_head_dim
    )
    return query + kv + n * shape.v_head_dim * h


def _pair_macs(shape: ModelShape) -> int:
    """Multiply-adds of QK^T plus AV for one (query, key) pair of one layer, all heads."""
    if shape.multi_latent_attention:
        n = shape.num_attention_heads
        return n * (shape.qk_head_dim + shape.qk_pos_emb_head_dim + shape.v_head_dim)
    return 2 * shape.kv_channels * shape.num_attention_heads


def _core_attention_forward(shape: ModelShape, squared: int, left: int, right: int) -> int:
    """Forward FLOPs of QK^T and AV over all layers: 2 x `_pair_macs` per attended pair.

    Sliding-window layers drop the `left`/`right` pairs outside the window; full-attention layers
    (per `window_attn_skip_freq`) do not. MTP layers follow the last decoder layer's kind. DSA
    layers attend the top-k pairs (`left` then counts the pairs beyond the top-k cap).
    """
    macs = _pair_macs(shape)
    dsa = shape.dsa_layers
    pattern = shape.window_layer_pattern
    windowed = sum(pattern) + (shape.mtp_num_layers if pattern[-1] else 0)
    full = shape.num_layers + shape.mtp_num_layers - windowed - shape.linear_layers
    if shape.hybrid_layers is not None:
        counts = shape.hybrid_layers.counts
        windowed, full = 0, counts["attention"] + counts["mla"]
    elif dsa:
        full = 0
    if dsa:  # causal only; 2m * (Σs²/2 - L) per DSA layer, as a window of k - 1 keys
        n, rank, rope = shape.num_attention_heads, shape.kv_lora_rank, shape.qk_pos_emb_head_dim
        sparse = dsa * absorbed_pair_macs(n, rank, rope) * (squared - 2 * left)
        return macs * full * squared + sparse
    if shape.causal:
        # s^2/2 pairs per document, minus those left of the window: 2m * (Σs²/2 - L) = m * (Σs² - 2L).
        return macs * (full * squared + windowed * (squared - 2 * left))
    return 2 * macs * (full * squared + windowed * (squared - left - right))


def _indexer_forward(shape: ModelShape, squared: int, left: int) -> tuple[int, int]:
    """Forward FLOPs of the DSA indexer's scores over all causal pairs (Σs²/2 per layer, the kit's
    causal convention) and of its KL loss's target scores (all causal pairs, or the top-k pairs
    with the sparse loss; zero without the loss)."""
    dsa = shape.dsa_layers
    if not dsa:
        return 0, 0
    scores = dsa * indexer_pair_macs(shape.dsa_indexer_n_heads, shape.dsa_indexer_head_dim) * squared
    if not shape.dsa_indexer_loss:
        return scores, 0
    target = loss_target_pair_macs(shape.num_attention_heads, shape.kv_lora_rank, shape.qk_pos_emb_head_dim)
    pairs = squared - 2 * left if shape.dsa_indexer_use_sparse_loss else squared
    return scores, dsa * target * pairs


def _terms(
    shape: ModelShape, tokens: int, squared: int, left: int, right: int, adapter: LoraAdapter | None
) -> dict[str, int]:
    """Forward FLOPs of each term for the given sums."""
    forward = {name: per_token * tokens for name, per_token in _per_token_forward(shape).items()}
    forward["adapter"] = 2 * adapter_macs_per_token(shape, adapter) * tokens if adapter is not None else 0
    forward["core_attention"] = _core_attention_forward(shape, squared, left, right)
    forward["dsa_indexer_scores"], forward["dsa_indexer_loss"] = _indexer_forward(shape, squared, left)
    return {name: forward[name] for name in TERMS}


def _factors(shape: ModelShape, frozen_base: bool) -> dict[str, int]:
    """Multiple of its forward each term costs in training (forward, data and weight gradients).

    A frozen weight has no weight gradient. megatron-core runs the DSA indexer on detached inputs:
    without its KL loss, under no_grad (forward only); with it, its projections get a weight
    gradient but no data gradient and its scores a full backward; the loss's target is detached.
    """
    factor = {name: 2 if frozen_base and name not in _WEIGHTLESS else 3 for name in TERMS}
    loss = shape.dsa_indexer_loss
    factor.update(dsa_indexer=2 if loss else 1, dsa_indexer_scores=3 if loss else 1, dsa_indexer_loss=1)
    return factor


def training_flops(
    shape: ModelShape,
    stats: SeqlenStats,
    *,
    recompute: str | None = None,
    frozen_base: bool = False,
    adapter: LoraAdapter | None = None,
) -> FlopsBreakdown:
    """Forward + backward FLOPs of one global batch (reads the stats back: one sync per call).

    `recompute="full"` adds to the hardware count the forward of every transformer layer term
    (all but logits); `"selective"` adds the core-attention forward only (megatron's selective
    recomputation). Model FLOPs never include recomputation. Statistics that count malformed
    boundary rows raise ValueError: their sums are wrong.

    `frozen_base=True` (adapter fine-tuning): the base's weights get their forward and
    data-gradient GEMMs but no weight-gradient GEMM, so every weight term counts 2x its forward
    instead of 3x; core attention has no weights and keeps 3x. `adapter` (a `LoraAdapter`) adds
    the `adapter` term, trainable, 3x its forward.
    """
    from accounting.seqlens import SeqlenStats  # loaded already wherever statistics were made

    if not isinstance(stats, SeqlenStats):
        raise ValueError(
            f"training_flops: stats must be a SeqlenStats (from seqlen_stats or SeqlenStats.dense), "
            f"got {type(stats).__name__}"
        )
    _check_call(shape, stats.window, recompute)
    return flops_from_sums(
        shape,
        stats.to_dict(),
        window=stats.window,
        recompute=recompute,
        frozen_base=frozen_base,
        adapter=adapter,
    )


def _check_call(shape: ModelShape, window: tuple[int, int] | None, recompute: str | None) -> None:
    if not isinstance(shape, ModelShape):
        raise ValueError(f"training_flops: shape must be a ModelShape, got {type(shape).__name__}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute = {recompute!r}: expected one of {RECOMPUTE}")
    if shape.stats_window is not None and window != shape.stats_window:
        what = (
            "window_size" if shape.dsa_layers == 0 else "the DSA top-k cap (dsa_indexer_topk - 1 keys left)"
        )
        raise ValueError(
            f"shape.stats_window = {shape.stats_window} ({what}) but the stats were computed for window "
            f"{window}: pass window_size={shape.stats_window} to seqlen_stats / FlopsAccumulator"
        )


def _recomputed(name: str, recompute: str | None) -> int:
    """1 if activation recomputation runs term `name`'s forward again, else 0: "full" repeats every
    transformer layer term (all but logits), "selective" core attention only."""
    if recompute == "full":
        return int(name != "logits")
    return int(recompute == "selective" and name == "core_attention")


def flops_from_sums(
    shape: ModelShape,
    sums: dict[str, int],
    *,
    window: tuple[int, int] | None = None,
    recompute: str | None = None,
    frozen_base: bool = False,
    adapter: LoraAdapter | None = None,
) -> FlopsBreakdown:
    """`training_flops` from sums already read back (`SeqlenStats.to_dict()`): no tensor read at all."""
    _check_call(shape, window, recompute)
    if not isinstance(frozen_base, bool):
        raise ValueError(f"frozen_base = {frozen_base!r} must be a bool")
    if adapter is not None and not isinstance(adapter, LoraAdapter):
        raise ValueError(f"adapter must be a LoraAdapter or None, got {type(adapter).__name__}")
    v = dict(sums)
    if v.get("malformed_rows"):
        raise ValueError(
            f"training_flops: the statistics count {describe_malformed(v)}; validate_cu_seqlens(...) names "
            "the index"
        )
    if shape.stats_window is None:
        v["beyond_left"] = v["beyond_right"] = v["padded_beyond_left"] = v["padded_beyond_right"] = 0
    model_fwd = _terms(shape, v["tokens"], v["squared"], v["beyond_left"], v["beyond_right"], adapter)
    hw_fwd = _terms(
        shape,
        v["padded_tokens"],
        v["padded_squared"],
        v["padded_beyond_left"],
        v["padded_beyond_right"],
        adapter,
    )
    if frozen_base and shape.dsa_layers:
        raise ValueError("frozen_base with DeepSeek sparse attention layers is not modelled")
    factor = _factors(shape, frozen_base)
    terms = {name: factor[name] * value for name, value in model_fwd.items()}
    hardware_terms = {name: (factor[name] + _recomputed(name, recompute)) * hw_fwd[name] for name in TERMS}
    return FlopsBreakdown(
        total=sum(terms.values()),
        hardware_total=sum(hardware_terms.values()),
        terms=terms,
        hardware_terms=hardware_terms,
        recompute=recompute,
    )
