"""Step ``memory_estimate``: the memory estimate's fused attention against what flash attention keeps.

The estimate's default (fused) attention keeps, per layer, Q, K, V and the attention output
(Korthikanti's 8*s*b*h/t bytes in bf16, 2 bytes an element) and the softmax statistics, one fp32
value per query and head (4*a*s*b/t bytes: the estimate's fused minus its selective-recompute
figure), and no s x s score matrix. Here torch's flash scaled-dot-product attention (on the GPU in
bf16; in the dry run its CPU kernel, in fp32) runs at two lengths under `saved_tensors_hooks`:
the bytes it saves for its backward must equal that formula at each length, exactly (nothing
that grows as s*s is kept). 0-d tensors (the kernel's random-number seed and offset) are left out:
they do not grow with anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

# (heads, head dim, lengths): a GPU-sized attention, and a CPU-sized one for the dry run.
GPU_SHAPE = (8, 64, (1024, 2048))
CPU_SHAPE = (4, 16, (32, 64))


def saved_attention_bytes(
    heads: int, head_dim: int, seq_len: int, device: str, dtype: Any, backend: str = "FLASH_ATTENTION"
) -> tuple[int, str]:
    """(bytes of the distinct storages the attention saves for its backward, its backward's name).

    `backend` names a `torch.nn.attention.SDPBackend` ("MATH" is the unfused one, for a control).
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (
        torch.randn(1, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    inputs = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with (
        sdpa_kernel(getattr(SDPBackend, backend)),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backend == "FLASH_ATTENTION":  # it saves Q, K, V themselves (the math kernel, scaled copies)
        expect(set(inputs) <= set(saved), "flash attention did not save its inputs: not the kernel expected")
    return sum(saved.values()), out.grad_fn.name()


def formula_attention_bytes(heads: int, head_dim: int, seq_len: int, element_bytes: int) -> int:
    """The estimate's fused attention for one layer (TP = 1, b = 1), in a run of `element_bytes`."""
    from accounting import ModelShape
    from accounting.stage_memory import ParallelLayout, memory_estimate

    hidden = heads * head_dim
    shape = ModelShape(num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=128)
    fused, selective = (
        memory_estimate(shape, ParallelLayout(seq_len=seq_len, recompute=recompute))
        .stages[0]
        .activation_bytes
        for recompute in (None, "selective")
    )
    statistics = fused - selective  # 4*a*s*b/t: fp32 whatever the training dtype
    return 8 * seq_len * hidden * element_bytes // 2 + statistics


def step(check: CheckState) -> dict[str, Any]:
    """Flash attention's saved bytes at two lengths equal the fused formula's (the dry run: on the CPU)."""
    import torch

    device, dtype = ("cpu", torch.float32) if check.dry else ("cuda", torch.bfloat16)
    heads, head_dim, lengths = CPU_SHAPE if check.dry else GPU_SHAPE
    element = torch.empty((), dtype=dtype).element_size()
    figures: dict[str, Any] = {"device": device, "dtype": str(dtype), "heads": heads, "head_dim": head_dim}
    for seq_len in lengths:
        measured, kernel = saved_attention_bytes(heads, head_dim, seq_len, device, dtype)
        formula = formula_attention_bytes(heads, head_dim, seq_len, element)
        figures[str(seq_len)] = {"saved_bytes": measured, "formula_bytes": formula, "kernel": kernel}
        expect(
            measured == formula,
            f"seq {seq_len}: {kernel} saved {measured} bytes, the fused formula says {formula}",
        )
    return figures
