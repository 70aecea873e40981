"""The precision each FLOPs term runs in, and the time the work takes at each precision's peak.

Real runs mix precisions: Transformer Engine's FP8 recipes run the linear layers' GEMMs in FP8
while core attention stays in BF16 (and megatron-core's output layer and MoE router, which are
not TE modules, too). One peak for all of it either understates MFU (the BF16 peak) or
overstates it (the FP8 peak). Here MFU is

    MFU = (sum over terms t of F_t / P_t) / (T x N)

the time the same work would take with each term at its own precision's peak, over the time it
took: `F_t` the term's model FLOPs, `P_t` the peak of its precision on one device, `T` the
interval, `N` the devices. With one precision this is `F / (T x N x P)`.

`resolve_precisions` turns what a user says (a TE recipe name, one precision, or a mapping of
term groups / term names to precisions) into one precision per term of `flops.TERMS`;
`seconds_at_peak` gives the numerator, or None and the reason (never a guess) when a term's
precision or the device has no peak in the peak table (`throughput.lookup_peak`, passed in:
`throughput` imports this module).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from accounting.flops import TERMS

__all__ = ["GROUPS", "RECIPES", "resolve_precisions", "seconds_at_peak"]

# Groups of `flops.TERMS` by the kernels they run: GEMMs of linear layers (TE modules under an
# FP8 recipe), attention-like products without weights, the output layer, the router.
GROUPS: dict[str, tuple[str, ...]] = {
    "linear": (
        "attention_projections", "mla_projections", "dsa_indexer", "mamba", "gdn", "mlp", "moe", "mtp",
        "adapter",
    ),
    "attention": ("core_attention", "dsa_indexer_scores", "dsa_indexer_loss", "mamba_scan", "gdn_scan"),
    "logits": ("logits",),
    "router": ("moe_router",),
}  # fmt: skip
# megatron-core's --fp8-recipe names (Transformer Engine recipes): TE's linear modules run their
# GEMMs in FP8 (MXFP8 and block scaling at the FP8 rate); core attention stays in the training
# dtype unless FP8 attention is asked for (then give {"attention": "fp8"} as well).
RECIPES: dict[str, dict[str, str]] = {
    name: {"linear": "fp8"} for name in ("delayed", "tensorwise", "mxfp8", "blockwise")
}


def resolve_precisions(spec: str | Mapping[str, str] | None, default: str) -> dict[str, str]:
    """One precision per term of `flops.TERMS`; ValueError for a name that is neither.

    `spec` is None (every term in `default`), a recipe name of `RECIPES`, one precision for every
    term, or a mapping whose keys are `GROUPS` names or term names (a term's own entry wins over
    its group's); terms it does not name run in `default`.
    """
    if spec is None:
        return dict.fromkeys(TERMS, default)
    if isinstance(spec, str):
        spec = RECIPES.get(spec, dict.fromkeys(GROUPS, spec))
    if not isinstance(spec, Mapping):
        raise ValueError(f"precision = {spec!r}: expected a recipe name, a precision or a mapping")
    out = dict.fromkeys(TERMS, default)
    for key in sorted(spec, key=lambda k: k in TERMS):  # groups first, then terms override them
        value = spec[key]
        if not isinstance(value, str):
            raise ValueError(f"precision[{key!r}] = {value!r} must be a precision name such as 'bf16'")
        if key in GROUPS:
            out.update(dict.fromkeys(GROUPS[key], value))
        elif key in TERMS:
            out[key] = value
        else:
            raise ValueError(
                f"precision key {key!r} is neither a term group ({', '.join(GROUPS)}) nor a FLOPs term"
            )
    return out


def seconds_at_peak(
    terms: Mapping[str, int],
    precisions: Mapping[str, str],
    peak_of: Callable[[str], tuple[float | None, str]],
) -> tuple[float | None, dict[str, float], str | None]:
    """`(sum of F_t / P_t on one device, the peak of each precision used, None)`, or `(None, {}, reason)`.

    `peak_of(precision)` is `(peak FLOP/s, key)` or `(None, why)`, as `throughput.lookup_peak`
    for one device. Only terms with FLOPs need a peak: a precision named for a term this model
    does not have cannot make the answer unknown.
    """
    peaks: dict[str, float] = {}
    total = 0.0
    for term, flops in terms.items():
        if not flops:
            continue
        precision = precisions[term]
        if precision not in peaks:
            peak, key_or_reason = peak_of(precision)
            if peak is None:
                return None, {}, f"{term} runs in {precision}: {key_or_reason}"
            peaks[precision] = peak
        total += flops / peaks[precision]
    return total, peaks, None


def parse_precision(text: str) -> str | dict[str, str]:
    """The command line's `--precision`: a recipe or precision name, or `linear=fp8,attention=bf16`."""
    if "=" not in text:
        return text.strip()
    spec = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise ValueError(
                f"--precision {text!r}: expected GROUP=PRECISION pairs, e.g. linear=fp8,attention=bf16"
            )
        spec[key.strip()] = value.strip()
    return spec


def time_at_peak(
    terms: Mapping[str, int],
    spec: str | Mapping[str, str] | None,
    default: str,
    peak_of: Callable[[str], tuple[float | None, str]],
) -> dict:
    """What `flops --json` reports of one device: the work's seconds at each term's precision peak
    (the MFU numerator, per device) and at the single `default` peak, labelled, or the reason."""
    precisions = resolve_precisions(spec, default)
    seconds, peaks, reason = seconds_at_peak(terms, precisions, peak_of)
    single, single_reason = peak_of(default)
    total = sum(terms.values())
    return {
        "precision": {term: precisions[term] for term, flops in terms.items() if flops},
        "peaks": peaks or None,
        "seconds_at_peak": seconds,
        "seconds_at_peak_unavailable": reason,
        "single_peak_dtype": default,
        "seconds_at_single_peak": total / single if single else None,
        "seconds_at_single_peak_unavailable": None if single else single_reason,
    }
