"""megatron-core on a machine without CUDA: the CPU layer a rank function enters.

megatron-core assumes CUDA: it passes `torch.cuda.current_device()` straight into `device=`,
writes `device="cuda"` and `.cuda()` in about 40 files, seeds and saves RNG state through
`torch.cuda` (`model_parallel_cuda_manual_seed` fails with "Torch not compiled with CUDA
enabled" on a CPU build of torch), and asserts `param.grad.type() == "torch.cuda.FloatTensor"`
in the optimizer. Inside `cpu_shim()` exactly those calls land on the CPU, so the real
`GPTModel`, `parallel_state` (TP, PP, CP), DDP, optimizer and `dist_checkpointing` run over gloo.
It is a no-op where CUDA exists, so the same rank function runs unchanged on a GPU runner::

    from megatron_testkit.megatron_cpu import cpu_shim, destroy_model_parallel, init_model_parallel

    def train_one_step(rank, world_size):      # called by run_ranks in each rank
        with cpu_shim():
            init_model_parallel(tensor_model_parallel_size=2)
            ...                                 # build GPTModel, one step
            destroy_model_parallel()

What the shim changes while it is active (everything is restored on exit, even on an error):

- `torch.cuda.current_device()` returns `"cpu"` (megatron feeds it to `device=`);
- `torch.cuda.synchronize()` is a no-op;
- `torch.cuda.current_stream()` returns the CPU stream (`torch.cpu.current_stream()`, whose
  `wait_stream`/`wait_event` do nothing): megatron-core 0.19's
  `ParamAndGradBucketGroup.start_grad_sync` asks for the current CUDA stream on every gradient
  sync (to wait for CUDA-graph gradient events) and failed with "Torch not compiled with CUDA
  enabled" in `finish_grad_sync`;
- `torch.cuda.manual_seed`, `get_rng_state`, `set_rng_state` act on the CPU default generator;
  `manual_seed_all` is a no-op (mapping it to `torch.manual_seed` recurses: that calls it back);
- `megatron.core.tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state` use the CPU
  generator, which makes `model_parallel_cuda_manual_seed` and the RNG tracker work;
- `torch.cuda.device_count()` is 1 (the CPU each rank has) and `torch.cuda.set_device(n)` does
  nothing, so a torchrun-style init's ``set_device(rank % device_count())`` runs (it divided by zero);
- `torch.distributed.init_process_group` and `new_group` asked for NCCL (``backend="nccl"``, or a
  ``cuda:nccl`` part) get gloo, their CUDA ``device_id`` dropped: upstream's own test init asks for
  NCCL, and megatron-core passes the backend it was configured with to `new_group`;
- `torch.cuda.Stream()` is a CPU stream (`torch.cpu.Stream`, with ``synchronize``/``query``) and
  `torch.cuda.stream(s)` a context that does nothing (megatron's training loop and its
  dist_checkpointing open side streams);
- a `TorchFunctionMode` rewrites any CUDA `device` argument (keyword or positional, as in
  `.to("cuda")`) to CPU, makes `Tensor.cuda()` the identity, and makes `Tensor.type()` report
  `torch.cuda.*Tensor` for CPU tensors. A mode rather than per-file patches because the CUDA
  assumptions are spread over the whole package.

Every substitution is counted (`substitutions`): the call and how often, never silently. A rank
leaves its counts in its record and the launcher adds them to its process' counts; the session
report lists them once (``session.cpu_substitutions``).

Also here: `use_cpu_shim`, the same as a pytest fixture (for single-process tests: the shim acts
in the process that enters it, so a rank function enters it itself), and `init_model_parallel` /
`destroy_model_parallel`, which set up megatron's parallel state on the launch's process group
with only the keyword arguments the installed release accepts (megatron-core 0.16.1 through
0.19.2 are tested; differences are detected from signatures, never from version numbers).
Importing this module imports neither torch nor megatron; they load when the shim is entered.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from megatron_testkit.megatron_compat import call_with_supported_kwargs

__all__ = [
    "add_substitutions",
    "cpu_shim",
    "destroy_model_parallel",
    "init_model_parallel",
    "shim_active",
    "substitutions",
    "take_substitutions",
    "use_cpu_shim",
]

_active_depth = 0
# How often each call was substituted in this process since the counts were last taken.
_counts: dict[str, int] = {}
_DEVICE_REWRITE = "a CUDA device argument -> cpu"


def _count(call: str) -> None:
    _counts[call] = _counts.get(call, 0) + 1


def substitutions() -> dict[str, int]:
    """This process' substitutions not taken yet: ``{call: how often}``."""
    return dict(_counts)


def take_substitutions() -> dict[str, int]:
    """This process' substitutions since the last call, and start counting afresh."""
    taken = dict(_counts)
    _counts.clear()
    return taken


def add_substitutions(counts: dict[str, int]) -> None:
    """Add counts made elsewhere (a rank's, read from its record) to this process' counts."""
    for call, n in counts.items():
        _counts[call] = _counts.get(call, 0) + n


def _make_mode() -> Any:
    """A `TorchFunctionMode` that rewrites CUDA placements to CPU in every torch function call.

    Built on demand so that importing this module (the pytest plugin does) does not import torch.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    cpu = torch.device("cpu")

    def _is_cuda_device(value: Any) -> bool:
        if isinstance(value, torch.device):
            return value.type == "cuda"
        if isinstance(value, str):
            return value == "cuda" or value.startswith("cuda:")
        return False

    class CudaToCpuMode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.device:  # torch.device("cuda", 0) itself is intercepted too
                return cpu if args and _is_cuda_device(args[0]) else func(*args, **kwargs)
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs["device"] = cpu
                _count(_DEVICE_REWRITE)
            if any(_is_cuda_device(a) for a in args):
                args = tuple(cpu if _is_cuda_device(a) else a for a in args)
                _count(_DEVICE_REWRITE)
            result = func(*args, **kwargs)
            # `param.type()` with no argument: the optimizer and clip_grads check for CUDA tensors.
            if (
                func is torch.Tensor.type
                and len(args) == 1
                and not kwargs
                and isinstance(result, str)
                and result.startswith("torch.")
                and not result.startswith("torch.cuda.")
            ):
                return "torch.cuda." + result[len("torch.") :]
            return result

    return CudaToCpuMode()


def _cpu_manual_seed(seed: int) -> None:
    import torch

    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
    import torch

    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: Any, device: Any = -1, graph_safe: bool = False) -> None:
    import torch

    torch.set_rng_state(new_state)


def _cpu_current_stream(device: Any = None) -> Any:
    import torch

    return torch.cpu.current_stream()


def _gloo_backend(backend: Any) -> Any:
    """``nccl`` (alone or as a ``device:nccl`` part) becomes gloo; any other backend is kept."""
    if isinstance(backend, str) and "nccl" in backend.lower():
        return "gloo"
    return backend


def _gloo_instead_of_nccl(original: Any, call: str) -> Any:
    """``original`` (init_process_group, new_group) with an NCCL backend turned into gloo and a CUDA
    ``device_id`` dropped (gloo binds no device); counted when it changed something."""

    def substitute(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args and call == "init_process_group" else None)
        if call == "new_group" and len(args) >= 3:  # new_group(ranks, timeout, backend, ...)
            backend = args[2]
        gloo = _gloo_backend(backend)
        if gloo != backend:
            _count(f"torch.distributed.{call}(backend={backend!r}) -> gloo")
            if call == "new_group" and len(args) >= 3:
                args = (*args[:2], gloo, *args[3:])
            elif "backend" in kwargs or call != "init_process_group" or not args:
                kwargs["backend"] = gloo
            else:
                args = (gloo, *args[1:])
            kwargs.pop("pg_options", None)  # NCCL's options object: gloo takes none of its kind
        if kwargs.get("device_id") is not None:
            kwargs.pop("device_id")
            _count(f"torch.distributed.{call}(device_id=...) -> dropped")
        return original(*args, **kwargs)

    substitute.__wrapped__ = original  # type: ignore[attr-defined]
    return substitute


def _cpu_stream_class() -> Any:
    """A CPU stand-in for `torch.cuda.Stream`: `torch.cpu.Stream`, which waits for nothing, with
    the methods CUDA code calls on its side streams."""
    import torch

    class CpuStream(torch.cpu.Stream):
        def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
            _count("torch.cuda.Stream() -> CPU stream")
            super().__init__()

        def synchronize(self) -> None:
            return None

        def query(self) -> bool:
            return True

    return CpuStream


def _cpu_stream_context(stream: Any = None) -> Any:
    _count("torch.cuda.stream(...) -> no-op context")
    return contextlib.nullcontext(stream)


def _counted(call: str, replacement: Any) -> Any:
    """``replacement``, counting each call under ``call``."""

    def counted(*args: Any, **kwargs: Any) -> Any:
        _count(call)
        return replacement(*args, **kwargs)

    return counted


def _patch_table() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for every attribute the shim replaces."""
    import torch
    import torch.cuda.random as cuda_random
    import torch.distributed as dist

    table: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda device=None: None),
        # megatron-core 0.19 ParamAndGradBucketGroup.start_grad_sync: torch.cuda.current_stream()
        (torch.cuda, "current_stream", _cpu_current_stream),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda, "manual_seed_all", lambda seed: None),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        # A torchrun-style init: set_device(rank % device_count()) before its process group.
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "set_device", lambda device: None),
        (cuda_random, "manual_seed", _cpu_manual_seed),
        (cuda_random, "manual_seed_all", lambda seed: None),
        (cuda_random, "get_rng_state", _cpu_get_rng_state),
        (cuda_random, "set_rng_state", _cpu_set_rng_state),
    ]
    table = [(obj, name, _counted(f"torch.cuda.{name}", fn)) for obj, name, fn in table]
    # Counted by themselves: a class, and a context whose count names what it stands for.
    table += [(torch.cuda, "Stream", _cpu_stream_class()), (torch.cuda, "stream", _cpu_stream_context)]
    for call in ("init_process_group", "new_group"):
        original = getattr(dist, call)
        table.append((dist, call, _gloo_instead_of_nccl(original, call)))
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        if c10d is not None and getattr(c10d, call, None) is original:
            table.append((c10d, call, _gloo_instead_of_nccl(original, call)))
    return table


_MEGATRON_RANDOM = "megatron.core.tensor_parallel.random"


def _megatron_table(import_it: bool) -> list[tuple[Any, str, Any]]:
    """megatron-core's CUDA RNG state functions, imported first when ``import_it`` (else only
    when megatron-core is imported already)."""
    if import_it:
        try:
            import megatron.core.tensor_parallel.random  # noqa: F401
        except ImportError:  # megatron not installed: the torch part still helps plain torch code
            return []
    mcore_random = sys.modules.get(_MEGATRON_RANDOM)
    if mcore_random is None:
        return []
    return [
        (mcore_random, "_get_cuda_rng_state", _counted("megatron _get_cuda_rng_state", _cpu_get_rng_state)),
        (mcore_random, "_set_cuda_rng_state", _counted("megatron _set_cuda_rng_state", _cpu_set_rng_state)),
    ]


# What the outermost shim replaced: (object, attribute, original), restored on its exit.
_saved: list[tuple[Any, str, Any]] = []


def _apply(table: list[tuple[Any, str, Any]]) -> None:
    for obj, name, replacement in table:
        _saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, replacement)


def cover_late_imports() -> None:
    """While a shim that did not import megatron-core is active: cover megatron-core's RNG state
    functions once it has been imported (the session-wide shim calls this before each test)."""
    if _active_depth > 0 and not any(obj is sys.modules.get(_MEGATRON_RANDOM) for obj, _, _ in _saved):
        _apply(_megatron_table(import_it=False))


def shim_active() -> bool:
    """True while `cpu_shim()` is patching (never on a machine with CUDA)."""
    return _active_depth > 0


@contextlib.contextmanager
def cpu_shim(*, import_megatron: bool = True) -> Iterator[None]:
    """Make megatron-core's CUDA calls run on the CPU for the duration of the block.

    A no-op when CUDA is available. Re-entrant: a nested use leaves the outer one in charge.
    Everything it patches is restored on exit, even when the block raises. With
    ``import_megatron=False`` megatron-core is not imported for its RNG functions (a session of
    plain torch tests never pays for it); `cover_late_imports` covers them once it is imported.
    """
    global _active_depth
    import torch

    if torch.cuda.is_available():
        yield
        return
    if _active_depth > 0:
        _active_depth += 1
        try:
            yield
        finally:
            _active_depth -= 1
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    table = _patch_table() + _megatron_table(import_megatron)
    mode = _make_mode()
    _active_depth = 1
    try:
        _apply(table)
        with mode:
            yield
    finally:
        for obj, name, original in reversed(_saved):
            setattr(obj, name, original)
        _saved.clear()
        _active_depth = 0


@pytest.fixture
def use_cpu_shim() -> Iterator[None]:
    """pytest fixture: megatron-core runs on CPU inside the test, and nothing leaks out of it."""
    with cpu_shim():
        yield


def init_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    *,
    seed: int = 1234,
    **extra: Any,
) -> None:
    """Initialise megatron's parallel state on an already initialised default process group.

    Then seeds the model-parallel RNG tracker (`model_parallel_cuda_manual_seed`), which needs the
    shim on CPU. Keyword arguments the installed megatron-core does not know are dropped, so the
    call works across versions; `extra` is passed through on the same terms.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mcore_random

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    from megatron_testkit.flight_recorder import megatron_timeout_minutes

    # Inside a launch, megatron's groups time out with the launch's default group, not after 30 min.
    extra.setdefault("distributed_timeout_minutes", megatron_timeout_minutes())
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    call_with_supported_kwargs(
        parallel_state.initialize_model_parallel,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        **extra,
    )
    mcore_random.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down megatron's parallel state and its global microbatch calculator, if set."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    with contextlib.suppress(ImportError, AttributeError):
        from megatron.core import num_microbatches_calculator as nmc

        nmc.destroy_num_microbatches_calculator()
