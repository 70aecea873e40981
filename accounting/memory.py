"""Memory reports (CUDA allocator or host RSS) and their per-key MAX across a group of ranks.

`reduce_max_memory` runs exactly one collective of one float64 tensor of fixed length, so ranks
whose reports differ can never be misaligned or deadlocked by different tensor sizes: every rank
sends `_CAPACITY` value slots plus a key-set hash and key count, and every rank sees a mismatch
and raises the same ValueError. Byte counts are far below 2**53 (9 PB), where float64 stops
representing integers exactly, so the round trip through float64 is exact for them.
"""

from __future__ import annotations

import hashlib
import resource
import sys
from typing import Any

import torch

__all__ = ["memory_report", "reduce_max_memory"]

# torch.cuda.memory_stats() key -> report key.
_CUDA_KEYS = {
    "allocated_bytes.all.current": "allocated_bytes",
    "allocated_bytes.all.peak": "peak_allocated_bytes",
    "active_bytes.all.current": "active_bytes",
    "active_bytes.all.peak": "peak_active_bytes",
    "inactive_split_bytes.all.current": "inactive_split_bytes",
    "inactive_split_bytes.all.peak": "peak_inactive_split_bytes",
    "reserved_bytes.all.current": "reserved_bytes",
    "reserved_bytes.all.peak": "peak_reserved_bytes",
    "num_alloc_retries": "alloc_retries",
    "num_ooms": "ooms",
}
# Value slots of the reduce tensor: a fixed length keeps the collective's shape rank-independent.
_CAPACITY = 128
# Flag slot value (MAX-reduced with the 0/1 overflow flag): some rank has a non-numeric value.
_BAD_VALUE = 2.0


def _host_rss_bytes() -> tuple[int, int]:
    """Current and peak resident set size of this process, in bytes.

    The peak is /proc's VmHWM, not `ru_maxrss`: Linux carries `ru_maxrss` over an exec, so a rank
    spawned from a large pytest process would report its parent's RSS as its own peak.
    """
    current = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    current = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if peak is None:  # no /proc (macOS reports ru_maxrss in bytes, Linux in KiB)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    if current is None:
        current = peak
    return current, max(current, peak)


def memory_report(device: torch.device | str | int | None = None) -> dict[str, int]:
    """Memory counters as ints: the CUDA caching allocator's, or the host process' RSS.

    CUDA: current and peak allocated, active, inactive-split and reserved bytes, allocation
    retries and OOM count. CPU: `rss_bytes`, `peak_rss_bytes`. The default is CUDA only once this
    process has initialised CUDA, else the host: a process that never touched its GPU used host
    memory, and the allocator would report zeros for it. Asking for a CUDA device explicitly
    raises ValueError on a machine without CUDA, and before this process initialised CUDA
    (`torch.cuda.memory_stats()` is then `{}`: a peak of 0 that passes every budget); the report
    never initialises CUDA itself, which would create a context as a side effect.

    What the allocator counts is what torch allocated through it: the CUDA context, NCCL's own
    buffers and anything a library allocates with `cudaMalloc` directly are not in these bytes,
    and neither are they under `torch.cuda.set_per_process_memory_fraction` (which caps the same
    allocator); `torch.cuda.mem_get_info()` sees the whole card.
    """
    if device is None:
        on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        device = torch.device("cuda") if on_cuda else torch.device("cpu")
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            # torch.cuda.memory_stats would answer all zeros: a peak of 0 passes every budget.
            raise ValueError(f"memory_report(device={str(device)!r}): CUDA is not available on this machine")
        if not torch.cuda.is_initialized():
            raise ValueError(
                f"memory_report(device={str(device)!r}): this process has not initialised CUDA, so the "
                "caching allocator has no statistics and every counter would read 0; report after "
                "the first CUDA allocation, or ask for device='cpu'"
            )
        stats = torch.cuda.memory_stats(device)
        return {name: int(stats.get(key, 0)) for key, name in _CUDA_KEYS.items()}
    current, peak = _host_rss_bytes()
    return {"rss_bytes": current, "peak_rss_bytes": peak}


def _key_hash(keys: list[str]) -> float:
    """A 52-bit hash of the key set, exactly representable in float64."""
    digest = hashlib.blake2b("\0".join(keys).encode(), digest_size=8).digest()
    return float(int.from_bytes(digest, "little") & ((1 << 52) - 1))


def _bad_value(report: dict[str, Any], keys: list[str]) -> str | None:
    """The message for this rank's first non-numeric value, or None when every value is a number."""
    for key in keys:
        if not isinstance(report[key], (int, float)):
            return f"reduce_max_memory: report[{key!r}] = {report[key]!r} is not an int, float or bool"
    return None


def _restore_type(original: Any, value: float) -> Any:
    """bool -> bool (MAX of bools is a logical OR), int -> int, float stays float."""
    if isinstance(original, bool):
        return value != 0.0
    if isinstance(original, int):
        return int(value)
    return value


def _group_size(group: Any) -> int | None:
    size = getattr(group, "size", None)
    return size() if callable(size) else None


def reduce_max_memory(
    report: dict[str, Any], group: Any, *, return_ranks: bool = False
) -> dict[str, Any] | tuple[dict[str, Any], dict[str, int]]:
    """Per-key MAX of `report` over `group`, in one collective; returns a new dict.

    int values come back int, floats float, bools bool (their MAX is a logical OR); `bool` is
    not treated as `int`. No-op returning `report` itself when it is empty, torch.distributed is
    not initialised, or `group` has size 1 or no callable `size`. With `return_ranks=True` returns
    `(values, ranks)` where `ranks[key]` is the global rank holding the maximum (lowest on ties);
    that mode all-gathers the values (bytes grow with the group size: 8 * (_CAPACITY + 5) per
    rank, ~1 MB for 1000 ranks, acceptable at logging frequency), the default mode all-reduces.
    Reports with different key sets, or a value that is not a number on any rank, raise
    ValueError on every rank (after the collective, so no rank is left waiting).
    """
    dist = torch.distributed
    if not report or not (dist.is_available() and dist.is_initialized()):
        return _no_op(report, return_ranks)
    size = _group_size(group)
    if size is None or size <= 1:
        return _no_op(report, return_ranks)

    keys = sorted(report)
    # A bad value must not raise before the collective (the other ranks would wait forever): it
    # travels as a flag, and every rank raises after the collective.
    bad = _bad_value(report, keys)
    values = [0.0 if bad else float(report[k]) for k in keys]
    overflow = len(keys) > _CAPACITY
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    buf = torch.zeros(_CAPACITY + 5, dtype=torch.float64, device=device)
    if not overflow:
        buf[: len(values)] = torch.tensor(values, dtype=torch.float64)
    key_hash, count = _key_hash(keys), float(len(keys))
    flag = _BAD_VALUE if bad else float(overflow)
    buf[_CAPACITY:] = torch.tensor([key_hash, -key_hash, count, -count, flag], dtype=torch.float64)

    if return_ranks:
        # Flat output: gloo only accepts the concatenation, NCCL takes both.
        gathered = torch.empty(size * buf.numel(), dtype=torch.float64, device=buf.device)
        dist.all_gather_into_tensor(gathered, buf, group=group)
        rows = gathered.view(size, buf.numel()).cpu()
        _check_alignment(
            keys, rows[:, _CAPACITY].tolist(), rows[:, _CAPACITY + 2].tolist(), rows[:, -1].tolist(), bad
        )
        maxima = rows[:, : len(keys)].max(dim=0).values
        ranks = _lowest_rank_at_max(rows[:, : len(keys)], maxima)
        global_ranks = [dist.get_global_rank(group, r) for r in ranks]
        out = {k: _restore_type(report[k], float(m)) for k, m in zip(keys, maxima.tolist(), strict=True)}
        return {k: out[k] for k in report}, {k: g for k, g in zip(keys, global_ranks, strict=True)}

    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    tail = buf[_CAPACITY:].cpu().tolist()
    hashes_agree = tail[0] == -tail[1] == key_hash
    counts_agree = tail[2] == -tail[3] == count
    _check_alignment(
        keys, [key_hash if hashes_agree else -1.0], [count if counts_agree else -1.0], [tail[4]], bad
    )
    maxima = buf[: len(keys)].cpu().tolist()
    reduced = {k: _restore_type(report[k], m) for k, m in zip(keys, maxima, strict=True)}
    return {k: reduced[k] for k in report}


def _lowest_rank_at_max(rows: torch.Tensor, maxima: torch.Tensor) -> list[int]:
    """For each column, the first (lowest) group rank whose value equals the column's maximum."""
    hits = rows == maxima.unsqueeze(0)
    return hits.to(torch.int64).argmax(dim=0).tolist()


def _check_alignment(
    keys: list[str], hashes: list[float], counts: list[float], flags: list[float], bad: str | None = None
) -> None:
    """Raises a ValueError on every rank when a rank's report is unusable or the key sets differ."""
    if bad is not None:
        raise ValueError(bad)
    if any(f == _BAD_VALUE for f in flags):
        raise ValueError(
            "reduce_max_memory: another rank's report has a value that is not an int, float or bool"
        )
    if any(flags):
        raise ValueError(f"reduce_max_memory: a rank's report has more than {_CAPACITY} keys")
    own_hash, own_count = _key_hash(keys), float(len(keys))
    if any(h != own_hash for h in hashes) or any(c != own_count for c in counts):
        raise ValueError(
            "reduce_max_memory: ranks report different keys (this rank has "
            f"{len(keys)}: {keys}); every rank must report the same keys"
        )


def _no_op(report: dict[str, Any], return_ranks: bool):
    if not return_ranks:
        return report
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return report, {k: rank for k in report}
