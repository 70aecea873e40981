"""Step ``environment``: torch, CUDA, NCCL, device, megatron-core; the kit's modules import."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import StepFailed, expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState


def step(check: CheckState) -> dict[str, Any]:
    """The versions the other steps run on; a missing GPU fails here unless this is a dry run."""
    import torch

    import accounting  # noqa: F401
    import fixtures.training  # noqa: F401
    import megatron_testkit.ranks  # noqa: F401
    from megatron_testkit import devices, flight_recorder  # noqa: F401

    figures: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        from megatron.core import package_info

        figures["megatron_core"] = package_info.__version__
    except ImportError as exc:
        raise StepFailed(
            f"megatron-core does not import ({exc}): carry its wheel (ci/gpu_check.sh)"
        ) from None
    figures["cuda_available"] = torch.cuda.is_available()
    if check.dry:
        return figures
    expect(torch.cuda.is_available(), "torch.cuda.is_available() is False: no GPU for the GPU check")
    figures.update(
        device=torch.cuda.get_device_name(0),
        gpus=torch.cuda.device_count(),
        cuda=torch.version.cuda,
        nccl=nccl_version(),
    )
    return figures


def nccl_version() -> str:
    """NCCL's version as a dotted string, whatever form this torch reports it in."""
    import torch

    version = torch.cuda.nccl.version()  # a tuple in recent torch, an int (e.g. 21803) before
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
