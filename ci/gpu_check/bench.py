"""Step ``bench``: three ways to count a pack, host time per microbatch, at 8/512/8192 documents.

`add_microbatch` on CUDA behind a busy stream against one ``.item()`` per microbatch (as
Megatron-Bridge's `_real_subseq_lengths` does with a device argmin) and a ``.tolist()`` loop;
figures in OUTDIR/bench.json (and bench.png when matplotlib is installed).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

VARIANTS = ("add_microbatch", "item_per_microbatch", "tolist_loop")
BUSY_CYCLES = 2_000_000  # ~1 ms on a ~2 GHz SM clock


def step(check: CheckState) -> dict[str, Any]:
    """Measure (CPU tensors and 3 repeats in a dry run, CUDA and 50 on the GPU); write the figures."""
    figures = bench_add_microbatch(cuda=not check.dry, repeat=3 if check.dry else 50)
    (check.out / "bench.json").write_text(json.dumps(figures, indent=2))
    write_bench_figure(figures, check.out / "bench.png")
    return figures


def bench_add_microbatch(
    *, cuda: bool, repeat: int, docs: tuple[int, ...] = (8, 512, 8192)
) -> dict[str, Any]:
    """Host time per microbatch of three ways to count a pack, each behind a busy stream on CUDA.

    Before every microbatch a short sleeping kernel is queued (the stand-in for the microbatch's
    forward pass); `add_microbatch` only queues its own kernels behind it, the other two wait for
    it: one `.item()` of the device argmin (Megatron-Bridge's `_real_subseq_lengths` when the argmin
    lives on the device), or a `.tolist()` of the boundaries and a Python loop.
    """
    from ci.benchmarks.accounting_packs import make_pack

    device = "cuda" if cuda else "cpu"
    table = {}
    for n in docs:
        variants = _variants(make_pack(n, 1).to(device))
        table[str(n)] = {name: _us_per_call(fn, cuda=cuda, repeat=repeat) for name, fn in variants.items()}
    return {"device": device, "repeat": repeat, "busy_stream": cuda, "us_per_microbatch": table}


def _variants(cu: Any) -> dict[str, Callable[[], Any]]:
    """The three ways to count the pack `cu`, by name (see `VARIANTS`)."""
    import torch

    from accounting import FlopsAccumulator
    from ci.benchmarks.accounting_packs import syncing_stats

    acc = FlopsAccumulator(packed=True)

    def item_per_microbatch() -> torch.Tensor:
        row = cu[0]
        end = int(torch.argmin(row).item())  # the first -1 of the tail: the one sync
        lengths = row[1:end] - row[: end - 1]
        return (lengths.to(torch.int64) ** 2).sum()

    return {
        "add_microbatch": lambda: acc.add_microbatch(cu_seqlens=cu, seq_len=8192 * 8),
        "item_per_microbatch": item_per_microbatch,
        "tolist_loop": lambda: syncing_stats(cu),
    }


def _us_per_call(fn: Callable[[], Any], *, cuda: bool, repeat: int) -> float:
    """Host microseconds per call of `fn`, each call behind a freshly queued busy kernel on CUDA."""
    import torch

    def busy() -> None:
        if cuda:
            torch.cuda._sleep(BUSY_CYCLES)

    busy()
    fn()  # warm-up
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        busy()
        fn()
    elapsed = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return round(elapsed / repeat * 1e6, 1)


def write_bench_figure(figures: dict[str, Any], path: Path) -> None:
    """bench.png when matplotlib is there; the numbers are in bench.json either way."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    table = figures["us_per_microbatch"]
    docs = list(table)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.27
    for i, name in enumerate(VARIANTS):
        ax.bar(
            [j + (i - 1) * width for j in range(len(docs))], [table[d][name] for d in docs], width, label=name
        )
    ax.set_xticks(range(len(docs)), [f"{d} docs" for d in docs])
    ax.set_yscale("log")
    ax.set_ylabel("host µs per microbatch")
    busy = " behind a busy stream" if figures["busy_stream"] else ""
    ax.set_title(f"counting a pack on {figures['device']}{busy}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
