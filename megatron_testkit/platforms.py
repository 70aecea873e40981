"""Platform names: the key a launch's ranks name for the hardware they ran on (``cpu-gloo``,
``h100-nccl``), and the check that keeps a key one file-name word.

The launcher's ranks name their platform (`launch_platform`) and golden files are stored per
platform (`megatron_testkit.golden`): both import this module, and the launcher never imports a
golden module. Pure functions, stdlib only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from accounting.json_input import printable

# A platform key is one file-name word: ``cpu-gloo``, ``h100-nccl`` (never a path).
_PLATFORM = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
# What overrides the platform key (a runner the kit cannot name); checked by `check_platform`.
PLATFORM_ENV = "KIT_GOLDEN_PLATFORM"
# Words of a device name that are not its model: vendors and product lines.
_NOT_MODEL = ("nvidia", "amd", "tesla", "instinct")
# Words that name a part of one model with other clocks and power (the SXM part names none).
_PARTS = {"nvl": "nvl", "pcie": "pcie"}


class PlatformKeyError(ValueError):
    """A platform key the kit refuses (``KIT_GOLDEN_PLATFORM``, a report's ``metrics.platform``); one
    line naming where it came from."""


def launch_platform(backend: str, device_name: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The platform a launch's rank ran on, decided in the rank: ``KIT_GOLDEN_PLATFORM`` in its
    environment, else `platform_key` of its process group's backend and its own device."""
    return platform_override(environ) or platform_key(backend, device_name)


def platform_of_runs(runs: Iterable[Any], unnamed_gpu: Callable[[], str | None] | None = None) -> str:
    """The platform of the launches a test's metrics came from (the test's own and its fixtures').

    Each launch (`megatron_testkit.schema.Run`) carries the platform its ranks named; a launch
    recorded without one is named from its backend and device (``unnamed_gpu()`` for an NCCL
    launch without a device, e.g. an older record). The first launch on a GPU platform decides
    (a test that also ran a CPU launch is a GPU test); none: ``cpu-gloo``.
    """
    for run in runs:
        key = run.platform
        if key is None:
            device = run.device
            if device is None and run.backend == "nccl" and unnamed_gpu is not None:
                device = unnamed_gpu()
            key = platform_key(run.backend, device)
        if is_gpu_platform(key):
            return key
    return "cpu-gloo"


def platform_key(backend: str | None, gpu_name: str | None = None) -> str:
    """``cpu-gloo`` on CPU; ``<gpu model>-<backend>`` where the ranks ran on a GPU.

    ``NVIDIA H100 80GB HBM3`` over NCCL -> ``h100-nccl``; the NVL and PCIe parts are platforms of
    their own (``h200-nvl-nccl``), since their throughput is not the SXM part's. ``gpu_name`` is
    the ranks' own device (`torch.cuda.get_device_name()` in a rank); NCCL without a known name is
    ``gpu-nccl``. A gloo launch whose ranks used a GPU is ``<gpu model>-gloo``.
    """
    if backend == "nccl":
        return f"{gpu_slug(gpu_name or 'gpu')}-nccl"
    if gpu_name:
        return f"{gpu_slug(gpu_name)}-gloo"
    return "cpu-gloo"


def gpu_slug(name: str) -> str:
    """A GPU's model as one lowercase word, its NVL or PCIe part added: ``NVIDIA H200 NVL`` -> ``h200-nvl``."""
    words = [w for w in re.split(r"[^A-Za-z0-9]+", name) if w and w.lower() not in _NOT_MODEL]
    if not words:
        return "gpu"
    part = next((_PARTS[w.lower()] for w in words[1:] if w.lower() in _PARTS), None)
    return f"{words[0].lower()}-{part}" if part else words[0].lower()


def is_gpu_platform(platform: str) -> bool:
    """Whether a platform key names a GPU platform (throughput lower bounds apply only there)."""
    return not platform.startswith("cpu-")


def check_platform(platform: Any, source: str = "platform") -> str:
    """A platform key as a golden file's name takes it: lowercase letters, digits and ``_.-``, at
    most 64, no ``..``; `PlatformKeyError` naming `source` (``KIT_GOLDEN_PLATFORM``, a report's
    ``metrics.platform``) otherwise, so no key can move a file out of its folder."""
    if not isinstance(platform, str) or not _PLATFORM.fullmatch(platform) or ".." in platform:
        shown = printable(platform if isinstance(platform, str) else repr(platform), 80)
        raise PlatformKeyError(
            f"{source} {shown!r} is not a platform key (lowercase letters, digits and _.-, e.g. cpu-gloo or h100-nccl)"
        )
    return platform


def platform_override(environ: Mapping[str, str] | None = None) -> str | None:
    """``KIT_GOLDEN_PLATFORM`` checked by `check_platform`, or None when it is unset."""
    raw = (os.environ if environ is None else environ).get(PLATFORM_ENV, "")
    return check_platform(raw, PLATFORM_ENV) if raw else None
