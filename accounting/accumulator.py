"""Per-step FLOPs bookkeeping: microbatch statistics without syncs, one DP reduce, exact counters.

Usage per training step, on every rank:

    acc = FlopsAccumulator(packed=True, dp_group=dp_group)   # once
    for each microbatch:  acc.add_microbatch(cu_seqlens=..., cu_seqlens_padded=..., seq_len=...)
    step_flops = acc.step(shape)                               # after the optimizer step

Where the counting happens follows the boundaries, decided once per microbatch
(`boundaries.route`): CPU tensors go to the host's pending microbatches (their own buffer, no
torch kernel: `seqlen_host.HostMicrobatches`); device tensors are only staged (an int64 copy, at
most two kernels per microbatch, no sync) and all of a step's microbatches are counted together
at `resolve`/`step` with a fixed number of kernels (`microbatch_staging.StagedMicrobatches`).
One pending structure per kind; each knows its microbatches by index, for the step's error.

Counting in the data loader: the pack is made on the host, so its statistics can be made there
too, in the collate function, and the training step does no device work for FLOPs at all:

    def collate(samples):                                      # in the DataLoader (any worker)
        batch = pack(samples)                                  # your packing: tokens, cu_seqlens
        batch["flops_stats"] = seqlen_stats(batch["cu_seqlens"], pack_len=SEQ_LEN, window_size=W)
        return batch
    ...
    acc.add_microbatch(stats=batch["flops_stats"])             # in the step: Python ints, no kernel

Host statistics pickle as a few ints, so they cross worker processes cheaply; their window must be
the accumulator's. docs/counting-in-the-data-loader.md walks through it.

Whether a collective runs is decided by configuration (`packed`, the group), identically on every
rank, never by the data a rank happened to see: a rank with an empty pack (or no microbatch at all)
still joins the all-reduce, so it cannot deadlock the others.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch

from accounting.boundaries import route
from accounting.flops import TERMS, FlopsBreakdown, ModelShape, flops_from_sums
from accounting.microbatch_staging import StagedMicrobatches
from accounting.parallel_layout import (
    ParallelLayout,
    accumulator_from_parallel_state,
    accumulator_from_process_groups,
    check_dp_group,
)
from accounting.seqlen_fields import FIELDS, MALFORMED, MALFORMED_AT, wrap_int64
from accounting.seqlen_host import HostMicrobatches
from accounting.seqlens import (
    SeqlenStats,
    describe_malformed,
    normalize_window,
    to_device,
    validate_cu_seqlens,
)
from accounting.step_sums import exact_sums, fold_, fold_ints, high_words, unfold_, wrapped_fields

__all__ = ["FlopsAccumulator"]

_COUNTERS = ("total_flops", "hardware_total_flops", "total_tokens", "total_padded_tokens", "steps")
_COUNT_ON = ("auto", "device")


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _group_size(group: Any) -> int:
    return torch.distributed.get_world_size(group)


def _count(name: str, value: Any) -> int:
    """A Python int >= 0 (numpy ints too); no silent truncation of floats, no read of a tensor."""
    count = -1
    if not isinstance(value, (bool, torch.Tensor)):
        with contextlib.suppress(TypeError):
            count = operator.index(value)
    if count < 0:
        raise ValueError(f"add_microbatch: {name} = {value!r} must be an int >= 0 (not a float or a tensor)")
    return count


def _reduce_device(group: Any) -> torch.device:
    """The device a collective on `group` needs (NCCL only takes CUDA tensors)."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class FlopsAccumulator:
    """Accumulates one step's sequence statistics and the run's cumulative FLOPs (exact ints).

    `packed=True` (THD): each microbatch brings `cu_seqlens` (1-D or 2-D, either padding tail), or
    statistics made where the pack was made (`stats=`); `resolve` sums them over the pure
    data-parallel group with one int64 SUM all-reduce. With context parallelism, pass the DP group
    without CP: every CP rank of a DP rank sees the same full `cu_seqlens` and must be counted once.
    `packed=False` (BSHD): each microbatch is `micro_batch_size` x `seq_len` real tokens, identical
    on every DP rank, so `resolve` multiplies by the DP size and runs no collective.
    Malformed boundaries never give a silently wrong count: the statistics carry malformed-row
    counters, and `step` (which reads the vector anyway) raises a ValueError naming the microbatch
    and what is wrong. `validate=True` also runs the exact, syncing `validate_cu_seqlens` on every
    microbatch (debug mode), which names the index at once. `count_on="device"` stages every
    microbatch for the kernel path, CPU tensors too (what a device runs; tests and benchmarks
    compare it with the host path that `"auto"` takes for CPU tensors).
    `from_parallel_state` / `from_process_groups` give it a `layout` that refuses the wrong group,
    a CP rank's sliced length and a VPP chunk without `vp_stage` (`accounting.parallel_layout`).
    """

    layout: ParallelLayout | None = None  # set by from_parallel_state / from_process_groups

    def __init__(
        self,
        packed: bool,
        *,
        dp_group: Any = None,
        dp_size: int | None = None,
        window_size: int | tuple[int, int] | None = None,
        recompute: str | None = None,
        device: torch.device | str | None = None,
        validate: bool = False,
        count_on: str = "auto",
    ) -> None:
        if not isinstance(packed, bool):
            raise ValueError(f"packed = {packed!r} must be a bool, declared at construction")
        if count_on not in _COUNT_ON:
            raise ValueError(f"count_on = {count_on!r}: expected one of {_COUNT_ON}")
        self.packed = packed
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.window = normalize_window(window_size)
        self.recompute = recompute
        self.device = torch.device(device) if device is not None else None
        self.validate = validate
        self.count_on = count_on
        self.total_flops = 0
        self.hardware_total_flops = 0
        self.total_tokens = 0
        self.total_padded_tokens = 0
        self.steps = 0
        # Model FLOPs by term since construction (for MFU by precision: only its deltas are read,
        # so it is not part of the checkpointed state; anchor the meter at it after a resume).
        self.total_terms = dict.fromkeys(TERMS, 0)
        self.last_breakdown: FlopsBreakdown | None = None
        self.last_stats: SeqlenStats | None = None
        # One pending structure per kind: the host's (exact ints) and the device's (staged tensors).
        self._host = HostMicrobatches(self.window)
        self._device = StagedMicrobatches()
        self._host_or_none = self._host if count_on == "auto" else None  # count_on="device": all staged
        self._reset_microbatches()

    def _reset_microbatches(self) -> None:
        self._host.clear()
        self._device.clear()
        # This rank's step so far: its statistics (a wrapped sum counted as malformed), the high words
        # of its sums (`accounting.step_sums`) and whether they wrapped; made at the first look.
        self._local: tuple[SeqlenStats, Any, Any] | None = None
        self._dense = [0] * len(FIELDS)  # dense microbatches' sums, exact ints (never wrapped here)
        self.num_microbatches = 0

    def add_microbatch(
        self,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_padded: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        seq_len: int | None = None,
        micro_batch_size: int | None = None,
        vp_stage: int | None = None,
        stats: SeqlenStats | None = None,
    ) -> None:
        """Adds one microbatch (no sync). Only `vp_stage in (None, 0)` counts (VPP dedup).

        Packed: `cu_seqlens` is required, or `stats` (from `seqlen_stats`, made where the pack was
        made: nothing is counted here then); the pack length of the linear layers is `seq_len`
        when given (the configured, un-CP-sliced length), else `tokens.shape[-1]`. Dense: the
        batch is `micro_batch_size` (else `tokens.shape[0]`) x `seq_len` (else `tokens.shape[1]`).
        """
        if self.layout is not None:
            seq_len = self.layout.length_to_count(tokens, seq_len, vp_stage)
        if vp_stage is not None and _count("vp_stage", vp_stage):
            return  # a later model chunk's report of a microbatch its first chunk counted
        if not self.packed:
            self._add_dense(cu_seqlens, cu_seqlens_padded, stats, tokens, seq_len, micro_batch_size)
        elif stats is not None:
            self._add_stats(stats, cu_seqlens, cu_seqlens_padded)
        else:
            if cu_seqlens is None:
                raise ValueError(
                    "add_microbatch: a packed FlopsAccumulator needs cu_seqlens on every microbatch"
                )
            pack_len = seq_len if seq_len is not None else (tokens.shape[-1] if tokens is not None else None)
            if self.validate:  # debug mode: the exact, syncing check names the index at once
                validate_cu_seqlens(cu_seqlens, cu_seqlens_padded, pack_len=pack_len)
            route(
                self.num_microbatches,
                cu_seqlens,
                cu_seqlens_padded,
                pack_len,
                self._host_or_none,
                self._device,
            )
        self._local = None
        self.num_microbatches += 1

    def _add_stats(self, stats: SeqlenStats, cu_seqlens, cu_seqlens_padded) -> None:
        if cu_seqlens is not None or cu_seqlens_padded is not None:
            raise ValueError(
                "add_microbatch: pass either stats= or cu_seqlens=, not both (it would count twice)"
            )
        if not isinstance(stats, SeqlenStats):
            raise ValueError(
                f"add_microbatch: stats must be a SeqlenStats (from seqlen_stats), got {type(stats).__name__}"
            )
        if stats.window != self.window:
            raise ValueError(
                f"add_microbatch: stats computed for window {stats.window} but this FlopsAccumulator counts "
                f"window {self.window}: pass window_size={self.window} to seqlen_stats"
            )
        held = stats.held_ints()
        if held is not None:
            self._host.add_values(self.num_microbatches, held)
        else:
            self._device.add_vector(self.num_microbatches, stats.to_vector())

    def _add_dense(self, cu_seqlens, cu_seqlens_padded, stats, tokens, seq_len, micro_batch_size) -> None:
        if stats is not None:
            raise ValueError("add_microbatch: stats= is for a packed FlopsAccumulator (dense counts shapes)")
        if cu_seqlens is not None or cu_seqlens_padded is not None:
            raise ValueError(
                "add_microbatch: cu_seqlens= is for a packed FlopsAccumulator (packed=True); a dense one "
                "counts micro_batch_size x seq_len and would ignore the boundaries"
            )
        if micro_batch_size is None:
            if tokens is None:
                raise ValueError("add_microbatch: a dense FlopsAccumulator needs micro_batch_size or tokens")
            micro_batch_size = tokens.shape[0]
        if seq_len is None:
            if tokens is None:
                raise ValueError("add_microbatch: a dense FlopsAccumulator needs seq_len or tokens")
            seq_len = tokens.shape[-1]
        one = SeqlenStats.dense(
            _count("micro_batch_size", micro_batch_size), _count("seq_len", seq_len), window_size=self.window
        ).held_ints()
        self._dense = [a + b for a, b in zip(self._dense, one, strict=True)]
        self._local = None

    def local_stats(self) -> SeqlenStats:
        """This rank's statistics of the current step so far (no collective; kernels only for staged ones).

        Sums of valid microbatches that pass 2**63 together (int64 would wrap) count as one malformed
        row of the `int64` kind, which `step` and `training_flops` refuse.
        """
        return self._local_sums()[0]

    def _local_sums(self) -> tuple[SeqlenStats, Any, Any]:
        """(this rank's statistics, their high words, whether they wrapped): ints or device tensors."""
        if self._local is None:
            self._local = self._dense_sums(1) if not self.packed else self._packed_sums()
        return self._local

    def _dense_sums(self, factor: int) -> tuple[SeqlenStats, list[int], int]:
        return self._host_sums([value * factor for value in self._dense])

    def _host_sums(self, exact: list[int]) -> tuple[SeqlenStats, list[int], int]:
        """Statistics of exact host sums as int64 holds them, their high words, whether they wrapped."""
        high = high_words(exact)
        ints, wrapped = fold_ints([wrap_int64(v) for v in exact], high)
        return SeqlenStats._from_ints(ints, self.window), high, wrapped

    def _packed_sums(self) -> tuple[SeqlenStats, Any, Any]:
        exact = self._host.exact_total()
        device = self._device.total(self.window) if len(self._device) else None
        if device is None and (exact is not None or self.device is None):
            return self._host_sums(exact or [0] * len(FIELDS))
        if device is None:  # nothing counted, statistics asked on the accumulator's device
            vector, high = torch.zeros(2, len(FIELDS), dtype=torch.int64, device=self.device)
            return SeqlenStats.from_vector(vector, window=self.window), high, 0
        vector, high = device
        if exact is not None:  # both: the host's sums join the device's (one copy, no sync)
            host = [wrap_int64(v) for v in exact] + high_words(exact)
            host = to_device(torch.tensor(host, dtype=torch.int64), vector.device)
            vector, high = vector + host[: len(FIELDS)], high + host[len(FIELDS) :]
        wrapped = fold_(vector, high)
        return SeqlenStats.from_vector(vector, window=self.window), high, wrapped

    def resolve(self, dp_group: Any = None, dp_size: int | None = None) -> SeqlenStats:
        """Global-batch statistics: packed = one SUM all-reduce over `dp_group`; dense = local x DP size.

        Packed mode with torch.distributed initialised and a world larger than one requires a
        `dp_group` (here or at construction): defaulting to the world would over-count under
        tensor, pipeline or context parallelism. Dense mode there requires `dp_size` or
        `dp_group`: defaulting to 1 would under-count. A group whose size is not the DP size (the
        declared `dp_size`, else megatron-core's when its parallel state is initialised) is
        refused. Sums that pass 2**63 (int64 would wrap), over this rank's microbatches or over the
        ranks, count as one malformed row of the `int64` kind (decided without a read).
        """
        return self._resolve(dp_group, dp_size)[0]

    def _resolve(self, dp_group: Any, dp_size: int | None) -> tuple[SeqlenStats, Any, Any]:
        """`resolve`, with the high words of its sums and whether this rank's own sums wrapped."""
        group = dp_group if dp_group is not None else self.dp_group
        declared = dp_size if dp_size is not None else self.dp_size
        check_dp_group(group, self.layout.dp_size if self.layout is not None else declared)
        if not self.packed:
            size = dp_size if dp_size is not None else self.dp_size
            if size is None and group is None and _dist_ready() and torch.distributed.get_world_size() > 1:
                raise ValueError(
                    "FlopsAccumulator(packed=False).resolve: pass dp_size= or dp_group= (the pure "
                    "data-parallel group); without them the global batch would count one DP rank only"
                )
            if size is None:
                size = _group_size(group) if group is not None and _dist_ready() else 1
            return (*self._dense_sums(size)[:2], self._local_sums()[2])
        local = self._local_sums()
        if not _dist_ready():
            return local
        if group is None:
            if torch.distributed.get_world_size() == 1:
                return local
            raise ValueError(
                "FlopsAccumulator(packed=True).resolve: pass dp_group= (the pure data-parallel group, "
                "without CP/TP/PP ranks); the default world group would over-count"
            )
        if _group_size(group) == 1:
            return local
        device = self.device if self.device is not None else _reduce_device(group)
        # One int64 tensor: the sums, then their high words, which the same SUM adds up. A new
        # tensor, so the local statistics stay as they were; without this rank's own wrap count,
        # which the reduced sums count again.
        stats, high, wrapped = local
        held, fields = stats.held_ints(), len(FIELDS)
        if held is not None:
            vec = to_device(torch.tensor([*held, *high], dtype=torch.int64), device)
        else:
            vec = torch.cat([stats.to_vector(device=device), high.to(device)])
        if not isinstance(wrapped, int) or wrapped:  # a tensor is never read here
            unfold_(vec[:fields], wrapped)
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM, group=group)
        fold_(vec[:fields], vec[fields:])
        return SeqlenStats.from_vector(vec[:fields], window=self.window), vec[fields:], wrapped

    @classmethod
    def from_parallel_state(cls, packed: bool, **kwargs: Any) -> FlopsAccumulator:
        """Groups and sizes from megatron-core's parallel state (`accounting.parallel_layout`)."""
        return accumulator_from_parallel_state(cls, packed, **kwargs)

    @classmethod
    def from_process_groups(cls, packed: bool, **kwargs: Any) -> FlopsAccumulator:
        """Groups and sizes from explicit process groups and the model config (`accounting.parallel_layout`)."""
        return accumulator_from_process_groups(cls, packed, **kwargs)

    def step(
        self,
        shape: ModelShape,
        *,
        dp_group: Any = None,
        dp_size: int | None = None,
        recompute: str | None = None,
    ) -> int:
        """Resolves, adds this step's model FLOPs to `total_flops`, resets; returns the step's FLOPs.

        Reads the statistics vector back once (the step's only sync).
        Raises ValueError, on every rank of the group alike, when any rank's microbatches held
        malformed boundaries; the step is then discarded (nothing added, state reset).
        """
        stats, high, _ = self._resolve(dp_group, dp_size)
        if stats.held_ints() is None and stats.tokens.is_meta:
            self._reset_microbatches()
            raise ValueError(
                "FlopsAccumulator.step: the microbatches' boundaries are meta tensors, which hold no values "
                "to count; resolve() and local_stats() run on them (for tracing), step() needs real ones"
            )
        values = stats.to_dict()
        if values["malformed_rows"]:
            message = self._malformed_message(values, high)
            self._reset_microbatches()
            raise ValueError(message)
        breakdown = flops_from_sums(
            shape,
            values,
            window=stats.window,
            recompute=recompute if recompute is not None else self.recompute,
        )
        self.total_flops += breakdown.total
        for name, value in breakdown.terms.items():
            self.total_terms[name] += value
        self.hardware_total_flops += breakdown.hardware_total
        self.total_tokens += values["tokens"]
        self.total_padded_tokens += values["padded_tokens"]
        self.steps += 1
        self.last_breakdown = breakdown
        self.last_stats = stats
        self._reset_microbatches()
        return breakdown.total

    def _per_microbatch(self) -> list[list[int]]:
        """This rank's vector of each counted microbatch, in order (reads the device ones: one sync)."""
        vectors = {**self._host.per_microbatch(), **self._device.per_microbatch(self.window)}
        return [vectors[index] for index in range(self.num_microbatches)]

    def _malformed_message(self, values: dict[str, int], high: Any) -> str:
        """Which of this rank's microbatches were malformed and how, or which sums wrapped (reads
        their counters: one sync)."""
        found = []
        for index, vector in enumerate(self._per_microbatch() if self.packed else ()):
            counts = vector[MALFORMED_AT:]
            if counts[0]:
                kinds = ", ".join(text for text, n in zip(MALFORMED.values(), counts[1:], strict=True) if n)
                rows = f"{counts[0]} malformed row{'s' if counts[0] != 1 else ''}"
                found.append(f"microbatch {index} has {rows} ({kinds})")
        high = high if isinstance(high, list) else high.tolist()
        wrapped = wrapped_fields(list(values.values()), high)
        if not found and wrapped:
            exact = dict(zip(FIELDS, exact_sums(list(values.values()), high), strict=True))
            sums = ", ".join(f"{name} = {exact[name]}" for name in wrapped)
            scope = (
                f"this rank's {self.num_microbatches} microbatches"
                if self._local_sums()[2]
                else "the data-parallel ranks' microbatches"
            )
            return (
                f"FlopsAccumulator.step: this step's sums over {scope} reach 2**63 or more ({sums}): "
                "past what the int64 sums hold exactly, each microbatch valid on its own. The step is not counted"
            )
        where = (
            "; ".join(found)
            if found
            else f"another data-parallel rank's microbatches: {describe_malformed(values)}"
        )
        return (
            f"FlopsAccumulator.step: {where}. The step is not counted; FlopsAccumulator(validate=True) "
            "or validate_cu_seqlens(...) names the index"
        )

    def state_dict(self) -> dict[str, int]:
        """The cumulative counters as Python ints (exact at any size; never float32)."""
        return {name: getattr(self, name) for name in _COUNTERS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the counters; accepts ints or integer-valued 0-d int64 tensors, rejects floats.

        A counter left out is 0 (a checkpoint of an older release); every one given must be an
        int >= 0. Nothing is restored unless every counter is valid.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state_dict must be a dict of counters, got {type(state).__name__}")
        restored = {}
        for name in _COUNTERS:
            value = state.get(name, 0)
            if isinstance(value, torch.Tensor):
                if value.dtype.is_floating_point or value.numel() != 1 or value.is_meta:
                    raise ValueError(f"state_dict[{name!r}] must be an int, got a {value.dtype} tensor")
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"state_dict[{name!r}] = {value!r} must be an int (floats lose precision)")
            if value < 0:
                raise ValueError(
                    f"state_dict[{name!r}] = {value} must be >= 0: a counter never goes below zero"
                )
            restored[name] = value
        for name, value in restored.items():
            setattr(self, name, value)
