"""Platform keys from the ranks' own device names: NVL and PCIe parts apart, launches decide.

The names are what `torch.cuda.get_device_name()` returns for each part (NVIDIA's naming); the
expected keys are written out by hand from the stated rule (the model word, plus ``nvl``/``pcie``
for a part whose clocks and power differ from the SXM part's).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_testkit import platforms

pytestmark = pytest.mark.L0


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-nccl"),
        ("NVIDIA H100 PCIe", "h100-pcie-nccl"),
        ("NVIDIA H100 NVL", "h100-nvl-nccl"),
        ("NVIDIA H200", "h200-nccl"),
        ("NVIDIA H200 NVL", "h200-nvl-nccl"),
        ("NVIDIA A100-SXM4-80GB", "a100-nccl"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-nccl"),
        ("NVIDIA GH200 480GB", "gh200-nccl"),
        ("NVIDIA B200", "b200-nccl"),
        ("AMD Instinct MI300X", "mi300x-nccl"),
    ],
)
def test_each_part_is_its_own_platform(name: str, key: str) -> None:
    # "H200 NVL" used to fold into h200 with the SXM part, "AMD Instinct MI300X" into "instinct".
    assert platforms.platform_key("nccl", name) == key


def test_a_gloo_launch_is_a_cpu_platform_unless_its_ranks_used_a_gpu() -> None:
    assert platforms.platform_key("gloo") == platforms.platform_key("gloo", None) == "cpu-gloo"
    assert platforms.platform_key("gloo", "NVIDIA H200") == "h200-gloo"
    assert platforms.is_gpu_platform("h200-gloo") and not platforms.is_gpu_platform("cpu-gloo")


def _run(backend: str, device: str | None = None, platform: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(backend=backend, device=device, platform=platform)


def test_the_first_gpu_launch_decides_and_older_records_are_named_from_backend_and_device() -> None:
    runs = [_run("gloo", platform="cpu-gloo"), _run("nccl", "NVIDIA H200 NVL", "h200-nvl-nccl")]
    assert platforms.platform_of_runs(runs) == "h200-nvl-nccl"
    assert platforms.platform_of_runs([_run("gloo", platform="cpu-gloo")]) == "cpu-gloo"
    assert platforms.platform_of_runs([]) == "cpu-gloo"
    # A record without the ranks' platform (an older report, a torchrun job): its backend and device.
    assert platforms.platform_of_runs([_run("nccl", "NVIDIA H100 PCIe")]) == "h100-pcie-nccl"
    # ...and without a device either: the plugin's fallback names the GPU (nvidia-smi there).
    assert platforms.platform_of_runs([_run("nccl")], unnamed_gpu=lambda: "NVIDIA H200") == "h200-nccl"
    assert platforms.platform_of_runs([_run("nccl")]) == "gpu-nccl"


def test_the_ranks_environment_names_a_launchs_platform_before_its_device() -> None:
    assert platforms.launch_platform("nccl", "NVIDIA H200", {}) == "h200-nccl"
    assert platforms.launch_platform("gloo", None, {"KIT_GOLDEN_PLATFORM": "h100-nccl"}) == "h100-nccl"
    assert platforms.launch_platform("gloo", None, {"KIT_GOLDEN_PLATFORM": ""}) == "cpu-gloo"
