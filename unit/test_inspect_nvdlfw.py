"""The nvdlfw-inspect side of `accounting.inspector` (`nvdlfw.py`), exercised on CPU without Transformer Engine.

TE is never installed on CPU, so the TE backend itself runs only on GPU runners. What can run
here is everything around it: the session configuration, the logger that parses nvdlfw-inspect's
`<layer>_<tensor>_<stat>` scalars back, the listeners and the merge into records. nvdlfw-inspect's
own generic `LogTensorStats` (namespace `base`) drives them, and since it computes the statistics
with its own code it is also an independent oracle for the hooks' partial-sum arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from accounting.inspector import (
    TE_STATS,
    InspectConfig,
    TensorInspector,
    combine_partials,
    end_nvdlfw_session,
    partial_stats,
    start_nvdlfw_session,
)
from accounting.inspector.nvdlfw import merge_scalars, parse_scalar_name, te_debug_mode_problem

pytestmark = pytest.mark.L0


@pytest.fixture
def nvdlfw_base(tmp_path):
    """A running nvdlfw-inspect session (generic namespace) and the scalars it hands out."""
    import nvdlfw_inspect.api as debug_api

    config = InspectConfig(layers=r".*linear_fc1$", tensors=("activation", "weight"), every=5)
    seen: list[tuple] = []
    session = start_nvdlfw_session(config, namespace="base", log_dir=tmp_path)
    session.subscribe(lambda *a: seen.append(a))
    try:
        yield debug_api, seen
    finally:
        session.end()
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
        parse_scalar_name(name, ("activation", "weight", "gradient"), ("min", "std", "l2_norm")) == expected
    )


def test_nvdlfw_scalars_merge_into_the_hooks_records() -> None:
    hooks = [{"step": 5, "rank": 1, "layer": "L", "tensor": "activation", "nan_count": 0}]
    merged = merge_scalars(
        hooks, [("L", "activation", "max", 2.0, 5), ("L", "weight", "min", -1.0, 5)], rank=1
    )
    assert merged == [
        {"step": 5, "rank": 1, "layer": "L", "tensor": "activation", "nan_count": 0, "max": 2.0},
        {"step": 5, "rank": 1, "layer": "L", "tensor": "weight", "min": -1.0},
    ]


def test_listeners_belong_to_their_session_not_to_the_module(tmp_path) -> None:
    """No process-global listener list: a second session does not inherit the first one's."""
    import nvdlfw_inspect.api as debug_api

    import accounting.inspector.nvdlfw as nvdlfw

    config = InspectConfig(layers="fc1", tensors=("activation",), stats=("max",), every=1)
    first: list[tuple] = []
    with start_nvdlfw_session(config, namespace="base", log_dir=tmp_path) as session:
        unsubscribe = session.subscribe(lambda *a: first.append(a))
        debug_api.log_tensor_stats(
            layer_name="fc1",
            tensor_name="activation",
            tensor=torch.tensor([1.0, 4.0]),
            iteration=1,
            skip_reduction=True,
        )
        unsubscribe()
        debug_api.log_tensor_stats(
            layer_name="fc1",
            tensor_name="activation",
            tensor=torch.tensor([9.0]),
            iteration=2,
            skip_reduction=True,
        )
    assert first == [("fc1", "activation", "max", 4.0, 1)]
    second: list[tuple] = []
    with start_nvdlfw_session(config, namespace="base", log_dir=tmp_path) as session:
        session.subscribe(lambda *a: second.append(a))
        debug_api.log_tensor_stats(
            layer_name="fc1",
            tensor_name="activation",
            tensor=torch.tensor([2.0]),
            iteration=3,
            skip_reduction=True,
        )
    assert second == [("fc1", "activation", "max", 2.0, 3)] and len(first) == 1
    mutable_globals = [
        name
        for name, value in vars(nvdlfw).items()
        if isinstance(value, (list, dict, set)) and not name.startswith("__")
    ]
    assert mutable_globals == []


def test_a_second_session_is_refused_while_one_runs(tmp_path) -> None:
    config = InspectConfig(every=1)
    with (
        start_nvdlfw_session(config, namespace="base", log_dir=tmp_path),
        pytest.raises(RuntimeError, match="already running"),
    ):
        start_nvdlfw_session(config, namespace="base", log_dir=tmp_path)
    end_nvdlfw_session()  # a no-op once the session has ended


# TE's `TEDebugState.debug_enabled` (transformer_engine/debug/pytorch/debug_state.py, v2.6 l.20/40):
# None before the first TE module is built, then whether an nvdlfw-inspect session existed at
# that moment; every TE forward reads it (pytorch/module/linear.py l.1338).
@pytest.mark.parametrize(("debug_enabled", "refused"), [(None, False), (True, False), (False, True)])
def test_te_modules_built_before_the_session_are_refused(debug_enabled, refused: bool) -> None:
    problem = te_debug_mode_problem(debug_enabled)
    assert (problem is not None) == refused
    if refused:
        assert "before building the model" in problem


def test_te_backend_without_a_session_is_refused_and_auto_uses_the_hooks() -> None:
    """Session-before-model is part of the API: the TE backend is only used with a session given."""
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="backend = 'te'"):
        TensorInspector(model, layers="fc1", backend="te")
    assert TensorInspector(model, layers="fc1").backend == "hooks"


def test_a_session_with_another_schedule_or_an_ended_one_is_refused(tmp_path) -> None:
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(4, 4))
    with start_nvdlfw_session(InspectConfig(layers="fc1", every=5), namespace="base", log_dir=tmp_path) as s:
        with pytest.raises(ValueError, match="every, layers"):
            TensorInspector(model, layers="fc1", every=3, session=s)
        assert TensorInspector(model, config=s.config, session=s).backend == "hooks"  # no TE on CPU
    with pytest.raises(ValueError, match="has ended"):
        TensorInspector(model, config=s.config, session=s)
