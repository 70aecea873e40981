"""Step ``sync``: `add_microbatch`/`resolve` raise nothing under ``set_sync_debug_mode("error")``.

`step` is where the one host sync is (counted under "warn"); the CUDA result must equal the same
microbatches counted on the CPU. The dry run runs the same rank on the CPU over gloo.
Rank functions are module-level so `run_ranks` can import them by name in fresh processes.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

SEQ_LEN = 8192 * 8
LLAMA = "llama3-8b"


def pack_cu_seqlens(docs: int, seed: int, pack_len: int = SEQ_LEN) -> tuple[Any, Any]:
    """A 1-D pack of `docs` documents with a -1 tail, and its padded form (lengths rounded to 8)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max(2, pack_len // docs // 2), (docs,), generator=gen)
    padded = (lengths + 7) // 8 * 8
    zero = torch.zeros(1, dtype=torch.int64)
    cu = torch.cat([zero, lengths.cumsum(0), torch.full((2,), -1)]).to(torch.int32)
    pad = torch.cat([zero, padded.cumsum(0), torch.full((2,), -1)]).to(torch.int32)
    return cu, pad


def sync_rank(rank: int, world_size: int, device: str) -> dict[str, Any]:
    """add_microbatch and resolve under sync-debug "error"; step's syncs counted under "warn"."""
    import torch.distributed as dist

    from accounting import FlopsAccumulator
    from accounting.presets import preset

    packs = [pack_cu_seqlens(docs, seed) for seed, docs in enumerate((8, 512, 8192, 1))]
    on_device = [(cu.to(device), pad.to(device)) for cu, pad in packs]
    cuda = device == "cuda"
    acc = FlopsAccumulator(packed=True, dp_group=dist.group.WORLD)
    with _sync_debug("error", cuda):
        for cu, pad in on_device:
            acc.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=pad, seq_len=SEQ_LEN)
        acc.resolve()
    control_raised = _plain_item_raises(on_device[0][0]) if cuda else None
    with _sync_debug("warn", cuda), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flops = acc.step(preset(LLAMA))
    # The same microbatches on the CPU, a second accumulator: the device path must agree exactly.
    ref = FlopsAccumulator(packed=True, dp_group=dist.group.WORLD)
    for cu, pad in packs:
        ref.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=pad, seq_len=SEQ_LEN)
    return {
        "flops": flops,
        "cpu_flops": ref.step(preset(LLAMA)),
        "step_syncs": sum("synchroniz" in str(w.message) for w in caught),
        "control_raised": control_raised,
    }


@contextmanager
def _sync_debug(mode: str, cuda: bool) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` for the block, back to off after it (no-op off CUDA)."""
    if not cuda:
        yield
        return
    import torch

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _plain_item_raises(cu: Any) -> bool:
    """The control: sync-debug "error" must catch a plain ``.item()``, or the mode proves nothing."""
    with _sync_debug("error", True):
        try:
            cu.sum().item()
        except RuntimeError:
            return True
    return False


def step(check: CheckState) -> dict[str, Any]:
    """The sync rank over NCCL on CUDA (gloo on the CPU in a dry run); the FLOPs agree with the CPU's."""
    from megatron_testkit.ranks import run_ranks

    backend, device = ("gloo", "cpu") if check.dry else ("nccl", "cuda")
    got = run_ranks(sync_rank, 1, backend=backend, args=(device,), timeout=min(120, check.remaining()))[0]
    expect(got["flops"] == got["cpu_flops"], f"device FLOPs {got['flops']} != CPU FLOPs {got['cpu_flops']}")
    if not check.dry:
        expect(got["control_raised"] is True, "sync debug mode 'error' did not catch a plain .item()")
    return got
