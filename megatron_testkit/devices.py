"""Per-rank device decisions: which backend a launch gets, which GPUs a rank sees, its memory caps.

Pure decisions (plus two small in-rank helpers) that `megatron_testkit.ranks`, `rank_worker` and
the plugin call, so each can be pinned by a CPU test without a GPU:

- a test that is not marked ``gpu`` runs over gloo with no visible CUDA device, even on a GPU
  machine, so it runs exactly as on the CPU runner (CPU tensors, `cpu_shim`, fp32, host budgets);
- ``KIT_DEVICE_MEMORY`` (the emulated CI card) never creates a CUDA context in a rank that does
  not use CUDA: the cap is queued to apply when CUDA initialises, not applied eagerly;
- a rank that uses CUDA gets a host allowance on top of its test's host budget (a CUDA context,
  cuBLAS/cuDNN and NCCL carry 2-4 GiB of host RSS that a CPU-measured budget never saw);
- ``KIT_REQUIRE_GPUS=N`` turns "skipped: not enough GPUs" into a failure on a job that promises N;
- a rank names its own device (`rank_device_name`, after ``CUDA_VISIBLE_DEVICES`` and the
  device binding), which is what the golden platform and the peak FLOP/s table are keyed on.

`set_per_process_memory_fraction` limits the caching allocator only: the CUDA context, NCCL's
own buffers and anything allocated with `cudaMalloc` outside torch are not counted by the cap,
so a device budget is a bound on the allocator's peak, not on the card's used memory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "CUDA_HOST_ALLOWANCE",
    "CUDA_HOST_ALLOWANCE_ENV",
    "DEVICE_MEMORY_ENV",
    "REQUIRE_GPUS_ENV",
    "GpuGate",
    "apply_device_cap",
    "choose_backend",
    "device_memory_cap",
    "gpu_gate",
    "host_budget",
    "rank_device_env",
    "rank_device_name",
    "rank_host_budget",
    "required_gpus",
    "uses_cuda",
]

DEVICE_MEMORY_ENV = "KIT_DEVICE_MEMORY"
REQUIRE_GPUS_ENV = "KIT_REQUIRE_GPUS"
CUDA_HOST_ALLOWANCE_ENV = "KIT_CUDA_HOST_ALLOWANCE"
# Host RSS a CUDA rank carries beyond what the same test measures on CPU: the upper end of the
# 2-4 GiB estimated for a CUDA + TE rank. `python -m ci gpu-check` prints the
# measured RSS of a CUDA rank so the figure can be replaced by a measurement; the environment
# variable overrides it per job.
CUDA_HOST_ALLOWANCE = 4 * 1024**3


def _parse_size(value: str, name: str) -> int:
    from megatron_testkit.budgets import parse_setting

    return parse_setting(name, value)


def choose_backend(requested: str, world_size: int, *, gpus: int, gpu_test: bool | None) -> str:
    """The backend of a launch: ``gloo``, ``nccl``, or what was asked for explicitly.

    ``auto`` gives NCCL only to a test marked ``gpu`` (``gpu_test=True``) with at least
    ``world_size`` visible GPUs; a test not marked ``gpu`` (``gpu_test=False``) always gets gloo,
    because its body passes CPU tensors ("No backend type associated with device type cpu" under
    NCCL). Outside pytest (``gpu_test=None``) the public rule holds: NCCL with enough GPUs.
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend={requested!r}: expected 'auto', 'gloo' or 'nccl'")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if requested != "auto":
        return requested
    if gpu_test is False:
        return "gloo"
    return "nccl" if gpus >= world_size else "gloo"


def rank_device_env(backend: str, *, gpu_test: bool | None) -> dict[str, str]:
    """Environment that decides which GPUs a rank sees: none for a gloo rank of a non-``gpu`` test.

    Hiding the devices (``CUDA_VISIBLE_DEVICES=""``) makes ``torch.cuda.is_available()`` False in
    the rank, so the test body, `cpu_shim`, the training harness and `memory_report` all take
    their CPU paths, and no CUDA context can be created by accident. A ``gpu`` test, an NCCL
    launch, or a launch outside pytest keeps the devices the parent sees.
    """
    if backend == "gloo" and gpu_test is False:
        return {"CUDA_VISIBLE_DEVICES": ""}
    return {}


def uses_cuda(backend: str, *, gpu_test: bool | None, environ: Mapping[str, str]) -> bool:
    """Whether a rank may use CUDA (and so gets the host allowance): NCCL, or a ``gpu`` test's rank.

    A rank whose devices are hidden never does, whatever it asked for.
    """
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return backend == "nccl" or gpu_test is True


def device_memory_cap(budget_device: int | None, environ: Mapping[str, str] | None = None) -> int | None:
    """The CUDA memory a rank's allocator may use: its device budget, capped by the emulated card.

    ``KIT_DEVICE_MEMORY`` is the CI card's memory (e.g. ``"40GiB"`` on a bigger local GPU).
    None when neither is set.
    """
    environ = os.environ if environ is None else environ
    card = environ.get(DEVICE_MEMORY_ENV)
    caps = [c for c in (budget_device, _parse_size(card, DEVICE_MEMORY_ENV) if card else None) if c]
    return min(caps) if caps else None


def apply_device_cap(rank: int, backend: str, cap: int | None) -> str:
    """Select this rank's GPU and cap its allocator; returns what it did (for the rank log).

    Every capped or NCCL rank selects ``rank % device_count``. NCCL ranks do it now, before
    anything allocates (NCCL needs the device set before the process group). Any other rank must
    not create a CUDA context for a cap alone: device and cap are queued with torch's
    lazy-initialisation hook and apply when (if ever) the rank first touches CUDA. Returns ``"eager"``, ``"lazy"`` or ``"none"``.
    """
    import torch

    if backend != "nccl" and cap is None:
        return "none"
    if not torch.cuda.is_available():
        return "none"

    def cap_now() -> None:
        # One device per rank, as before the cap became lazy; the fraction is set before the
        # rank's first allocation on it.
        local = rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        if cap is not None:
            total = torch.cuda.get_device_properties(local).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), local)

    if backend == "nccl":
        cap_now()
        return "eager"
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:  # a torch without the hook: no cap rather than a context in every rank
        return "none"
    lazy_call(cap_now)
    return "lazy"


def host_budget(
    budget_host: int | None, *, cuda: bool, environ: Mapping[str, str] | None = None
) -> int | None:
    """The host RSS limit a rank enforces: the test's budget, plus the CUDA allowance on a CUDA rank.

    Budgets are measured on CPU ranks; a CUDA rank's RSS also holds the driver, the CUDA context,
    cuBLAS/cuDNN and NCCL (and TE where it imports), which the test does not control. The
    allowance is ``KIT_CUDA_HOST_ALLOWANCE`` (a size) or `CUDA_HOST_ALLOWANCE`. No budget stays
    no budget.
    """
    if budget_host is None:
        return None
    if not cuda:
        return budget_host
    environ = os.environ if environ is None else environ
    raw = environ.get(CUDA_HOST_ALLOWANCE_ENV)
    allowance = _parse_size(raw, CUDA_HOST_ALLOWANCE_ENV) if raw else CUDA_HOST_ALLOWANCE
    return budget_host + allowance


def rank_host_budget(
    budget_host: int | None, backend: str, *, gpu_test: bool | None, environ: Mapping[str, str] | None = None
) -> int | None:
    """The host RSS limit a rank of this launch enforces: `host_budget` with `uses_cuda`'s answer.

    What `megatron_testkit.rank_worker` applies inside each rank (``environ`` is the rank's own
    environment, ``backend`` its process group's); a test that asserts a rank's peak against its
    budget calls this too, so a CUDA rank is held to the same limit the launcher holds it to.
    """
    environ = os.environ if environ is None else environ
    cuda = uses_cuda(backend, gpu_test=gpu_test, environ=environ)
    return host_budget(budget_host, cuda=cuda, environ=environ)


def rank_device_name() -> str | None:
    """This process' CUDA device as `torch.cuda.get_device_name()` names it, or None when it never used CUDA.

    The current device of a rank (bound by `apply_device_cap`), so it honours
    ``CUDA_VISIBLE_DEVICES`` and the rank's binding, unlike ``nvidia-smi -i 0``. Never
    initialises CUDA itself (a rank that ran on the CPU stays a CPU rank) and never raises: it
    is called while a failing rank writes its record.
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return None
        return str(torch.cuda.get_device_name(torch.cuda.current_device()))
    except Exception:  # torch half-imported, or a CUDA error: no name rather than no record
        return None


def required_gpus(environ: Mapping[str, str] | None = None) -> int:
    """``KIT_REQUIRE_GPUS`` as an int (0 when unset): the GPUs a job promises its tests."""
    environ = os.environ if environ is None else environ
    raw = environ.get(REQUIRE_GPUS_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{REQUIRE_GPUS_ENV}={raw!r}: expected a whole number of GPUs, e.g. 2") from None
    if value < 0:
        raise ValueError(f"{REQUIRE_GPUS_ENV}={raw!r}: must be >= 0")
    return value


@dataclass(frozen=True)
class GpuGate:
    """What the plugin does with a ``gpu`` test: ``run``, ``skip`` or ``fail``, and why."""

    action: str
    reason: str = ""
    capability: str = "cuda"  # what a skip declares (megatron_testkit.skips): cuda, or gpus for a count


def gpu_gate(visible: int, need: int | None, required: int) -> GpuGate:
    """Decide a ``gpu`` test when ``visible`` GPUs are seen and ``required`` are promised.

    ``need`` is its ``world_size(n)`` marker's n, or None without one (one GPU). Enough GPUs: run.
    Too few: skip with the plugin's reason, unless the job promised at least what the test needs
    (``KIT_REQUIRE_GPUS``), in which case the missing GPUs are the job's failure, not a skip, so a
    GPU job can no longer go green with every GPU test skipped. A test needing more than the job
    promised still skips.
    """
    if need is not None and need < 1:
        raise ValueError(f"a gpu test needs at least 1 GPU, got world_size({need})")
    wanted = 1 if need is None else need
    if visible >= wanted:
        return GpuGate("run")
    capability = "cuda" if visible == 0 else "gpus"
    if visible == 0:
        reason = "needs CUDA (marked gpu); no CUDA device is visible"
    else:
        reason = f"needs {wanted} GPUs (marked gpu, world_size({wanted})); {visible} visible"
    if required >= wanted:
        return GpuGate(
            "fail",
            f"{reason}; but {REQUIRE_GPUS_ENV}={required} promises {required}: "
            "the job lost its GPUs (driver, container --gpus, CUDA_VISIBLE_DEVICES)",
        )
    return GpuGate("skip", reason, capability)
