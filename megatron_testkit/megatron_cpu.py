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
- a `TorchFunctionMode` rewrites any CUDA `device` argument (keyword or positional, as in
  `.to("cuda")`) to CPU, makes `Tensor.cuda()` the identity, and makes `Tensor.type()` report
  `torch.cuda.*Tensor` for CPU tensors. A mode rather than per-file patches because the CUDA
  assumptions are spread over the whole package.

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
from collections.abc import Iterator
from typing import Any

import pytest

from megatron_testkit.megatron_compat import call_with_supported_kwargs

__all__ = ["cpu_shim", "destroy_model_parallel", "init_model_parallel", "shim_active", "use_cpu_shim"]

_active_depth = 0


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
            if any(_is_cuda_device(a) for a in args):
                args = tuple(cpu if _is_cuda_device(a) else a for a in args)
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


def _patch_table() -> list[tuple[Any, str, Any]]:
    """(object, attribute, replacement) for every attribute the shim replaces."""
    import torch
    import torch.cuda.random as cuda_random

    table: list[tuple[Any, str, Any]] = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda device=None: None),
        # megatron-core 0.19 ParamAndGradBucketGroup.start_grad_sync: torch.cuda.current_stream()
        (torch.cuda, "current_stream", _cpu_current_stream),
        (torch.cuda, "manual_seed", _cpu_manual_seed),
        (torch.cuda, "manual_seed_all", lambda seed: None),
        (torch.cuda, "get_rng_state", _cpu_get_rng_state),
        (torch.cuda, "set_rng_state", _cpu_set_rng_state),
        (cuda_random, "manual_seed", _cpu_manual_seed),
        (cuda_random, "manual_seed_all", lambda seed: None),
        (cuda_random, "get_rng_state", _cpu_get_rng_state),
        (cuda_random, "set_rng_state", _cpu_set_rng_state),
    ]
    try:
        from megatron.core.tensor_parallel import random as mcore_random
    except ImportError:  # megatron not installed: the torch part still helps plain torch code
        return table
    table += [
        (mcore_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        (mcore_random, "_set_cuda_rng_state", _cpu_set_rng_state),
    ]
    return table


def shim_active() -> bool:
    """True while `cpu_shim()` is patching (never on a machine with CUDA)."""
    return _active_depth > 0


@contextlib.contextmanager
def cpu_shim() -> Iterator[None]:
    """Make megatron-core's CUDA calls run on the CPU for the duration of the block.

    A no-op when CUDA is available. Re-entrant: a nested use leaves the outer one in charge.
    Everything it patches is restored on exit, even when the block raises.
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
    table = _patch_table()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in table]
    mode = _make_mode()
    _active_depth = 1
    try:
        for obj, name, replacement in table:
            setattr(obj, name, replacement)
        with mode:
            yield
    finally:
        for obj, name, original in reversed(saved):
            setattr(obj, name, original)
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
