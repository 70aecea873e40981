"""The nvdlfw-inspect side of `accounting.inspect`, exercised on CPU without Transformer Engine.

TE is never installed on CPU, so the TE backend itself runs only on GPU runners. What can run
here is everything around it: the session configuration, the logger that parses nvdlfw-inspect's
`<layer>_<tensor>_<stat>` scalars back, the listeners and the merge into records. nvdlfw-inspect's
own generic `LogTensorStats` (namespace `base`) drives them, and since it computes the statistics
with its own code it is also an independent oracle for the hooks' partial-sum arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from accounting.inspect import (
    NVDLFW_LISTENERS,
    TE_STATS,
    InspectConfig,
    _merge_scalars,
    _parse_nvdlfw_name,
    combine_partials,
    end_nvdlfw_session,
    partial_stats,
    start_nvdlfw_session,
)

pytestmark = pytest.mark.L0


@pytest.fixture
def nvdlfw_base(tmp_path):
    """A running nvdlfw-inspect session (generic namespace) and the scalars it hands out."""
    import nvdlfw_inspect.api as debug_api

    config = InspectConfig(layers=r".*linear_fc1$", tensors=("activation", "weight"), every=5)
    seen: list[tuple] = []
    start_nvdlfw_session(config, namespace="base", log_dir=tmp_path)
    NVDLFW_LISTENERS.append(lambda *a: seen.append(a))
    try:
        yield debug_api, seen
    finally:
        NVDLFW_LISTENERS.clear()
        end_nvdlfw_session()
    assert debug_api.DEBUG_MANAGER is None


def test_nvdlfw_generic_stats_agree_with_the_hooks_arithmetic(nvdlfw_base) -> None:
    debug_api, seen = nvdlfw_base
    torch.manual_seed(0)
    t = torch.randn(64, 48) * 3 + 0.5
    layer = "model.module.decoder.layers.1.mlp.linear_fc1"
    debug_api.log_tensor_stats(
        layer_name=layer, tensor_name="activation", tensor=t, iteration=5, skip_reduction=True
    )
    ours = combine_partials([partial_stats(t).tolist()], tuple(sorted(TE_STATS)))
    got = {
        stat: value
        for (lay, tensor, stat, value, step) in seen
        if (lay, tensor, step) == (layer, "activation", 5)
    }
    assert set(got) == TE_STATS
    for stat, value in got.items():
        assert value == pytest.approx(ours[stat], rel=1e-5), stat


def test_nvdlfw_session_respects_layers_tensors_and_frequency(nvdlfw_base) -> None:
    debug_api, seen = nvdlfw_base
    t = torch.randn(8, 8)
    fc1, head = "model.layers.1.linear_fc1", "model.head"
    debug_api.log_tensor_stats(
        layer_name=fc1, tensor_name="activation", tensor=t, iteration=6, skip_reduction=True
    )
    debug_api.log_tensor_stats(
        layer_name=head, tensor_name="activation", tensor=t, iteration=10, skip_reduction=True
    )
    debug_api.log_tensor_stats(
        layer_name=fc1, tensor_name="gradient", tensor=t, iteration=10, skip_reduction=True
    )
    assert seen == []  # off-step, unmatched layer, unconfigured tensor
    debug_api.log_tensor_stats(
        layer_name=fc1, tensor_name="weight", tensor=t, iteration=10, skip_reduction=True
    )
    assert {(lay, tensor, step) for lay, tensor, _, _, step in seen} == {(fc1, "weight", 10)}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "model.decoder.layers.1.mlp.linear_fc1_activation_l2_norm",
            ("model.decoder.layers.1.mlp.linear_fc1", "activation", "l2_norm"),
        ),
        ("a_b_weight_min", ("a_b", "weight", "min")),
        ("model.fc2_gradient_std", ("model.fc2", "gradient", "std")),
        ("model.fc2_gradient_median", None),
    ],
)
def test_nvdlfw_scalar_names_parse_back(name: str, expected) -> None:
    assert (
        _parse_nvdlfw_name(name, ("activation", "weight", "gradient"), ("min", "std", "l2_norm")) == expected
    )


def test_nvdlfw_scalars_merge_into_the_hooks_records() -> None:
    hooks = [{"step": 5, "rank": 1, "layer": "L", "tensor": "activation", "nan_count": 0}]
    merged = _merge_scalars(
        hooks, [("L", "activation", "max", 2.0, 5), ("L", "weight", "min", -1.0, 5)], rank=1
    )
    assert merged == [
        {"step": 5, "rank": 1, "layer": "L", "tensor": "activation", "nan_count": 0, "max": 2.0},
        {"step": 5, "rank": 1, "layer": "L", "tensor": "weight", "min": -1.0},
    ]
