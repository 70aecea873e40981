"""Per-step FLOPs bookkeeping: microbatch statistics without syncs, one DP reduce, exact counters.

Usage per training step, on every rank:

    acc = FlopsAccumulator(packed=True, dp_group=dp_group)   # once
    for each microbatch:  acc.add_microbatch(cu_seqlens=..., cu_seqlens_padded=..., seq_len=...)
    step_flops = acc.step(shape)                               # after the optimizer step

Where the counting happens follows the boundaries: CPU tensors are counted on the host as they
come (their own buffer, no torch kernel: `seqlen_host`); device tensors are only staged (an int64
copy, at most two kernels per microbatch, no sync) and all of a step's microbatches are counted
together at `resolve`/`step` with a fixed number of kernels (`microbatch_staging`).

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

from accounting.flops import TERMS, FlopsBreakdown, ModelShape, flops_from_sums
from accounting.microbatch_staging import StagedMicrobatches
from accounting.parallel_layout import (
    ParallelLayout,
    accumulator_from_parallel_state,
    accumulator_from_process_groups,
    check_dp_group,
)
from accounting.seqlen_fields import FIELDS, MALFORMED, MALFORMED_AT, wrap_int64
from accounting.seqlen_host import LOOP_LIMIT, buffer_values, host_values, list_values, plain_step
from accounting.seqlens import (
    SeqlenStats,
    check_boundaries,
    check_pack_len,
    describe_malformed,
    normalize_window,
    on_host,
    to_device,
    validate_cu_seqlens,
)

__all__ = ["FlopsAccumulator"]

_COUNTERS = ("total_flops", "hardware_total_flops", "total_tokens", "total_padded_tokens", "steps")
_COUNT_ON = ("auto", "device")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The common host case, checked in a few attribute reads: integer boundaries whose metadata alone
# cannot be wrong, and a pack length whose total over at most LOOP_LIMIT rows stays under 2**63.
_QUICK_DTYPES = frozenset({torch.int32, torch.int64})
_TENSOR = torch.Tensor
_QUICK_PACK_LEN = 2**56


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
        self._host_path = count_on == "auto"
        self._quick = packed and self._host_path  # then CPU boundaries may take add_microbatch's first branch
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
        self._staged = StagedMicrobatches()
        self._reset_microbatches()

    def _reset_microbatches(self) -> None:
        self._host: list[list[int]] = []  # per host-counted microbatch, its statistics as ints
        # per small host pack: its rows as lists (read at add_microbatch) and its pack length
        self._rows: list[tuple[list[list[int]], int | None]] = []
        self._device_stats: list[torch.Tensor] = []  # per `stats=` microbatch held on a device, its vector
        # Where each microbatch's vector is (which list, which index), by microbatch index; the
        # microbatches not named here are the `_rows` ones, in order.
        self._sources: dict[int, tuple[str, int]] = {}
        self._staged.clear()
        self._local: tuple[SeqlenStats, torch.Tensor | None] | None = None
        self._dense = SeqlenStats.zeros(window_size=self.window)
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
        if (
            type(cu_seqlens) is _TENSOR
            and self._quick
            and cu_seqlens_padded is None
            and stats is None
            and tokens is None
            and vp_stage is None
            and self.layout is None
            and not self.validate
            and (seq_len is None or (type(seq_len) is int and 0 <= seq_len < _QUICK_PACK_LEN))
            and cu_seqlens.is_cpu
            and cu_seqlens.dtype in _QUICK_DTYPES
            and (size := cu_seqlens.numel()) > 0
            and 0 < (dims := cu_seqlens.dim()) < 3
        ):  # the common host case in a few reads (`_add_packed` checks the rest): no function layer
            if size <= LOOP_LIMIT:  # its rows as lists, counted with the step's others at resolve
                self._rows.append((cu_seqlens.tolist() if dims == 2 else [cu_seqlens.tolist()], seq_len))
            else:
                self._sources[self.num_microbatches] = ("host", len(self._host))
                self._host.append(buffer_values(cu_seqlens, window=self.window, pack_len=seq_len))
            self._local = None
            self.num_microbatches += 1
            return
        if self.layout is not None:
            seq_len = self.layout.length_to_count(tokens, seq_len, vp_stage)
        if vp_stage not in (None, 0):
            return
        if not self.packed:
            if stats is not None:
                raise ValueError(
                    "add_microbatch: stats= is for a packed FlopsAccumulator (dense counts shapes)"
                )
            self._add_dense(tokens, seq_len, micro_batch_size)
        elif stats is not None:
            self._add_stats(stats, cu_seqlens, cu_seqlens_padded)
        else:
            self._add_packed(cu_seqlens, cu_seqlens_padded, tokens, seq_len)
        self._local = None
        self.num_microbatches += 1

    def _add_packed(self, cu_seqlens, cu_seqlens_padded, tokens, seq_len) -> None:
        if cu_seqlens is None:
            raise ValueError("add_microbatch: a packed FlopsAccumulator needs cu_seqlens on every microbatch")
        pack_len = seq_len if seq_len is not None else (tokens.shape[-1] if tokens is not None else None)
        if self.validate:
            validate_cu_seqlens(cu_seqlens, cu_seqlens_padded, pack_len=pack_len)
        two_d, rows = check_boundaries(cu_seqlens, cu_seqlens_padded)
        check_pack_len(pack_len, rows)
        if self._host_path and on_host(cu_seqlens, cu_seqlens_padded):
            values = host_values(cu_seqlens, cu_seqlens_padded, two_d, window=self.window, pack_len=pack_len)
            self._sources[self.num_microbatches] = ("host", len(self._host))
            self._host.append(values)
            return
        width = cu_seqlens.shape[-1]
        self._sources[self.num_microbatches] = ("staged", len(self._staged))
        self._staged.add(cu_seqlens, cu_seqlens_padded, rows, width, pack_len)

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
            self._sources[self.num_microbatches] = ("host", len(self._host))
            self._host.append(list(held))
        else:
            self._sources[self.num_microbatches] = ("device", len(self._device_stats))
            self._device_stats.append(stats.to_vector())

    def _add_dense(self, tokens, seq_len, micro_batch_size) -> None:
        if micro_batch_size is None:
            if tokens is None:
                raise ValueError("add_microbatch: a dense FlopsAccumulator needs micro_batch_size or tokens")
            micro_batch_size = tokens.shape[0]
        if seq_len is None:
            if tokens is None:
                raise ValueError("add_microbatch: a dense FlopsAccumulator needs seq_len or tokens")
            seq_len = tokens.shape[-1]
        self._dense = self._dense + SeqlenStats.dense(
            _count("micro_batch_size", micro_batch_size), _count("seq_len", seq_len), window_size=self.window
        )

    def local_stats(self) -> SeqlenStats:
        """This rank's statistics of the current step so far (no collective; kernels only for staged ones)."""
        if not self.packed:
            return self._dense
        return self._local_totals()[0]

    def _local_totals(self) -> tuple[SeqlenStats, torch.Tensor | None]:
        """(this rank's statistics, the staged microbatches' vectors `[k, fields]` or None), cached."""
        if self._local is not None:
            return self._local
        host = None
        if self._host or self._rows:
            parts = self._host + self._rows_values(totals=True)
            host = parts[0] if len(parts) == 1 else list(map(sum, zip(*parts, strict=True)))
            if min(host) < _INT64_MIN or max(host) > _INT64_MAX:  # as int64 sums wrap
                host = [wrap_int64(v) for v in host]
        device_parts, per_staged = [], None
        if len(self._staged):
            per_staged, staged_total = self._staged.totals(self.window)
            device_parts.append(staged_total)
        if self._device_stats:
            device_parts.append(torch.stack(self._device_stats).sum(0))
        if not device_parts:
            values = host if host is not None else [0] * len(FIELDS)
            if host is None and self.device is not None:
                local = SeqlenStats.zeros(window_size=self.window, device=self.device)
            else:
                local = SeqlenStats._from_ints(values, self.window)
        else:
            total = device_parts[0] if len(device_parts) == 1 else device_parts[0] + device_parts[1]
            if host is not None:
                total = total + to_device(torch.tensor(host, dtype=torch.int64), total.device)
            local = SeqlenStats.from_vector(total, window=self.window)
        self._local = (local, per_staged)
        return self._local

    def resolve(self, dp_group: Any = None, dp_size: int | None = None) -> SeqlenStats:
        """Global-batch statistics: packed = one SUM all-reduce over `dp_group`; dense = local x DP size.

        Packed mode with torch.distributed initialised and a world larger than one requires a
        `dp_group` (here or at construction): defaulting to the world would over-count under
        tensor, pipeline or context parallelism. Dense mode there requires `dp_size` or
        `dp_group`: defaulting to 1 would under-count. A group whose size is not the DP size (the
        declared `dp_size`, else megatron-core's when its parallel state is initialised) is refused.
        """
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
            return self._dense.scaled(size)
        local = self.local_stats()
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
        vec = local.to_vector(device=device).contiguous()  # a new tensor: the local one stays as it was
        torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.SUM, group=group)
        return SeqlenStats.from_vector(vec, window=self.window)

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
        stats = self.resolve(dp_group=dp_group, dp_size=dp_size)
        values = stats.to_dict()
        if values["malformed_rows"]:
            message = self._malformed_message(values)
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

    def _rows_values(self, *, totals: bool = False) -> list[list[int]]:
        """The vectors of the packs held as rows: their sum in one pass when `totals` and they allow it."""
        if not self._rows:
            return []
        summed = plain_step(self._rows) if totals and self.window is None else None
        if summed is not None:
            return [summed]
        return [list_values(rows, None, self.window, pack_len) for rows, pack_len in self._rows]

    def _per_microbatch(self) -> list[list[int]]:
        """This rank's vector of each counted microbatch, in order (reads the device ones: one sync)."""
        staged = self._local_totals()[1]
        read = {
            "host": self._host,
            "staged": staged.tolist() if staged is not None else [],
            "device": torch.stack(self._device_stats).tolist() if self._device_stats else [],
        }
        rows = iter(self._rows_values())
        return [
            read[found[0]][found[1]] if (found := self._sources.get(index)) else next(rows)
            for index in range(self.num_microbatches)
        ]

    def _malformed_message(self, values: dict[str, int]) -> str:
        """Which of this rank's microbatches were malformed and how (reads their counters: one sync)."""
        found = []
        for index, vector in enumerate(self._per_microbatch()):
            counts = vector[MALFORMED_AT:]
            if counts[0]:
                kinds = ", ".join(text for text, n in zip(MALFORMED.values(), counts[1:], strict=True) if n)
                rows = f"{counts[0]} malformed row{'s' if counts[0] != 1 else ''}"
                found.append(f"microbatch {index} has {rows} ({kinds})")
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
        """Restores the counters; accepts ints or integer-valued 0-d int64 tensors, rejects floats."""
        for name in _COUNTERS:
            value = state.get(name, 0)
            if isinstance(value, torch.Tensor):
                if value.dtype.is_floating_point or value.numel() != 1:
                    raise ValueError(f"state_dict[{name!r}] must be an int, got a {value.dtype} tensor")
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"state_dict[{name!r}] = {value!r} must be an int (floats lose precision)")
            setattr(self, name, value)
