"""Unit tests of `accounting.inspector.TensorInspector` on a plain torch model (single process).

Every expected statistic is recomputed here in float64 from a tensor captured by the test's own
hooks (or drawn by hypothesis), never from the inspector's partial sums.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from torch.overrides import TorchFunctionMode

from accounting.inspector import (
    SUPPORTED_STATS,
    InspectConfig,
    TensorInspector,
    combine_partials,
    layer_names,
    partial_stats,
    start_nvdlfw_session,
)
from fixtures.oracles import reference_stats  # numpy float64, independent of the inspector

pytestmark = pytest.mark.L0

ALL_TENSORS = ("activation", "weight", "output", "gradient", "dgrad")


class TinyMLP(torch.nn.Module):
    """Two blocks of fc1 -> gelu -> fc2 inside a ModuleList, plus a head that must not match."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([Block(hidden, i + 1) for i in range(2)])
        self.head = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Block(torch.nn.Module):
    def __init__(self, hidden: int, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number  # megatron-style 1-based global index
        self.fc1 = torch.nn.Linear(hidden, 2 * hidden)
        self.fc2 = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def assert_stats_close(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for key, expected in want.items():
        if key in ("nan_count", "inf_count"):
            assert got[key] == expected and isinstance(got[key], int), (key, got[key], expected)
        elif math.isnan(expected):
            assert math.isnan(got[key]), (key, got[key])
        else:
            assert got[key] == pytest.approx(expected, rel=rtol, abs=atol), (key, got[key], expected)


class Capture:
    """The test's own, independent capture of each matched layer's tensors in one step."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        modules = layer_names(model)
        self.seen: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str):
        def hook(module, args, output):
            self.seen.setdefault((name, "activation"), []).append(args[0].detach().clone())
            self.seen.setdefault((name, "output"), []).append(output.detach().clone())
            if (name, "weight") not in self.seen:
                self.seen[(name, "weight")] = [module.weight.detach().clone()]
            output.register_hook(lambda g: self.seen.setdefault((name, "gradient"), []).append(g.clone()))
            args[0].register_hook(lambda g: self.seen.setdefault((name, "dgrad"), []).append(g.clone()))

        return hook

    def tensor(self, layer: str, tensor: str) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in self.seen[(layer, tensor)]])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def train_step(model: torch.nn.Module, microbatches: int = 1, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(microbatches):
        x = torch.randn(4, 8, generator=gen, requires_grad=True)
        model(x).square().mean().backward()


# -- statistics -------------------------------------------------------------------------------


finite_floats = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def _float32_atol(values: np.ndarray) -> float:
    """Absolute slack for float32 data: a few ulps of its largest magnitude (e.g. the centring
    mean of a float32 tensor is itself a float32, within half an ulp of the true mean)."""
    return 4 * float(np.spacing(np.float32(np.abs(values).max()))) + 1e-12


@given(arrays(np.float32, st.integers(2, 200), elements=finite_floats))
def test_partial_stats_equal_independent_recomputation(values: np.ndarray) -> None:
    t = torch.from_numpy(values)
    got = combine_partials([partial_stats(t).tolist()], SUPPORTED_STATS)
    assert_stats_close(got, reference_stats(t), rtol=1e-5, atol=_float32_atol(values))


@given(st.lists(arrays(np.float32, st.integers(1, 50), elements=finite_floats), min_size=1, max_size=6))
def test_merged_partials_equal_stats_of_the_concatenation(chunks: list[np.ndarray]) -> None:
    whole = torch.from_numpy(np.concatenate(chunks))
    if whole.numel() < 2:
        return  # the unbiased std of one value is undefined; covered by the NaN test below
    rows = [partial_stats(torch.from_numpy(c)).tolist() for c in chunks]
    got = combine_partials(rows, SUPPORTED_STATS)
    assert_stats_close(got, reference_stats(whole), rtol=1e-5, atol=_float32_atol(whole.numpy()))


def test_nan_and_inf_are_counted_and_propagate_like_torch() -> None:
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 2.0, float("nan")])
    got = combine_partials([partial_stats(t).tolist()], SUPPORTED_STATS)
    assert got["nan_count"] == 2 and got["inf_count"] == 2
    for key in ("min", "max", "mean", "std", "l1_norm", "l2_norm"):
        assert math.isnan(got[key]), key
    only_inf = combine_partials([partial_stats(torch.tensor([1.0, float("inf")])).tolist()], SUPPORTED_STATS)
    assert only_inf["max"] == math.inf and only_inf["nan_count"] == 0 and only_inf["inf_count"] == 1


def test_single_value_has_undefined_unbiased_std() -> None:
    got = combine_partials([partial_stats(torch.tensor([3.0])).tolist()], ("std", "mean"))
    assert math.isnan(got["std"]) and got["mean"] == 3.0


# -- layers, steps, tensors -------------------------------------------------------------------


def test_layer_names_follow_nvdlfw_inspect_naming() -> None:
    names = layer_names(TinyMLP())
    assert "model.layers.1.fc1" in names and "model.layers.2.fc2" in names  # layer_number, 1-based
    assert "model.layers.0.fc1" not in names and "model.head" in names


class Wrapper(torch.nn.Module):
    """Holds the model as `.module`, as torch/megatron DDP does."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


def test_each_wrapper_adds_one_module_level_exactly_as_nvdlfw_inspect_names_it(tmp_path) -> None:
    """DDP(Float16Module(model)) under bf16: two `.module` levels, in our names and in nvdlfw's
    (which TE logs under, so the hooks' and TE's records must share them)."""
    import nvdlfw_inspect.api as debug_api
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True)
    model = Wrapper(Float16Module(config, TinyMLP()))
    names = layer_names(model)
    assert "model.module.module.layers.1.fc1" in names and "model.module.module.head" in names
    with start_nvdlfw_session(InspectConfig(every=1), namespace="base", log_dir=tmp_path):
        debug_api.infer_and_assign_layer_names(model)  # nvdlfw-inspect's own naming, as the oracle
    theirs = {m.name: m for m in model.modules() if not isinstance(m, torch.nn.ModuleList)}
    assert names.keys() == theirs.keys()
    assert all(names[n] is m for n, m in theirs.items())
    inspector = TensorInspector(model, layers=r"\.fc1$", every=1)
    assert inspector.layer_names == ["model.module.module.layers.1.fc1", "model.module.module.layers.2.fc1"]


@pytest.mark.parametrize(
    ("regex", "expected"),
    [
        (
            r".*(fc1|fc2)",
            ["model.layers.1.fc1", "model.layers.1.fc2", "model.layers.2.fc1", "model.layers.2.fc2"],
        ),
        (r"layers\.2\.fc1$", ["model.layers.2.fc1"]),
        (r"head", ["model.head"]),
    ],
)
def test_layer_regex_selects_exactly_the_matching_modules(regex: str, expected: list[str]) -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, layers=regex, every=1)
    assert inspector.layer_names == expected
    with inspector.step(1):
        train_step(model)
    assert sorted({r["layer"] for r in inspector.history}) == sorted(expected)


def test_regex_matching_nothing_is_an_error_that_names_it() -> None:
    with pytest.raises(ValueError, match="nope"):
        TensorInspector(TinyMLP(), layers="nope")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"every": 0}, "every"),
        ({"stats": ("median",)}, "stats"),
        ({"tensors": ("bias",)}, "tensors"),
        ({"layers": "("}, "layers"),
    ],
)
def test_invalid_configuration_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        InspectConfig(**kwargs)


def test_records_only_on_every_nth_step() -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, every=3, tensors=("weight",), stats=("l2_norm",))
    for step in range(1, 11):
        with inspector.step(step):
            train_step(model, seed=step)
    assert sorted({r["step"] for r in inspector.history}) == [3, 6, 9]


@pytest.mark.parametrize("microbatches", [1, 3])
def test_every_tensor_stat_equals_recomputation_from_an_independent_capture(microbatches: int) -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, tensors=ALL_TENSORS, every=2)
    for step in (1, 2):
        capture = Capture(model, inspector.layer_names) if step == 2 else None
        with inspector.step(step):
            train_step(model, microbatches=microbatches, seed=step)
        if capture:
            capture.close()
    records = {(r["layer"], r["tensor"]): r for r in inspector.history}
    assert set(records) == {(n, t) for n in inspector.layer_names for t in ALL_TENSORS}
    for (layer, tensor), rec in records.items():
        assert rec["step"] == 2
        assert_stats_close(rec, reference_stats(capture.tensor(layer, tensor)))
    assert all(records[(n, "gradient")]["l2_norm"] > 0 for n in inspector.layer_names)


def test_nan_and_inf_in_activations_are_counted() -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, layers=r"layers\.1\.fc1$", tensors=("activation",), every=1)
    x = torch.randn(4, 8)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), float("nan")
    with inspector.step(1):
        model(x)
    (rec,) = inspector.history
    assert (rec["nan_count"], rec["inf_count"]) == (2, 1) and math.isnan(rec["mean"])


# -- cost off-step ----------------------------------------------------------------------------


class CallLog(TorchFunctionMode):
    """Every torch function and tensor method called inside the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


SYNCS = {"item", "tolist", "cpu", "__bool__", "__float__", "__int__", "numpy"}


def test_off_step_registers_no_hooks_and_adds_no_tensor_operation() -> None:
    model = TinyMLP()
    with CallLog() as plain:
        train_step(model)
    inspector = TensorInspector(model, every=5, tensors=ALL_TENSORS)
    matched = [layer_names(model)[n] for n in inspector.layer_names]
    with CallLog() as off_step, inspector.step(4):
        assert not inspector.hooks_attached
        assert all(not m._forward_hooks for m in matched)
        train_step(model)
    assert off_step.calls == plain.calls  # not one extra op, so not one sync either
    assert inspector.history == []


def test_inspection_step_syncs_once_and_removes_its_hooks() -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, every=5, tensors=ALL_TENSORS)
    with CallLog() as log, inspector.step(5):
        assert inspector.hooks_attached
        train_step(model, microbatches=2)
    assert [c for c in log.calls if c in SYNCS] == ["cpu", "tolist"]  # the one host copy
    assert not inspector.hooks_attached
    assert all(not layer_names(model)[n]._forward_hooks for n in inspector.layer_names)


def test_hooks_are_removed_when_the_step_raises() -> None:
    model = TinyMLP()
    inspector = TensorInspector(model, every=1)
    with pytest.raises(RuntimeError), inspector.step(1):
        raise RuntimeError("boom")
    assert not inspector.hooks_attached


# -- writers ----------------------------------------------------------------------------------


def test_tensorboard_and_jsonl_outputs_read_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    model = TinyMLP()
    writer = SummaryWriter(str(tmp_path / "tb"))
    inspector = TensorInspector(
        model, layers=r"layers\.1\.fc2$", every=2, writer=writer, jsonl_path=tmp_path / "stats.jsonl"
    )
    for step in range(1, 5):
        with inspector.step(step):
            train_step(model, seed=step)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert lines == inspector.history
    assert {(r["step"], r["tensor"]) for r in lines} == {
        (s, t) for s in (2, 4) for t in ("activation", "weight", "gradient")
    }
    acc = EventAccumulator(str(tmp_path / "tb")).Reload()
    for rec in lines:
        for stat in SUPPORTED_STATS:
            events = acc.Scalars(f"inspect/model.layers.1.fc2/{rec['tensor']}/{stat}")
            (value,) = [e.value for e in events if e.step == rec["step"]]
            assert value == pytest.approx(rec[stat], rel=1e-6)  # TB stores float32


def test_activation_is_found_when_the_layer_is_called_with_keywords() -> None:
    fc1 = torch.nn.Linear(8, 4)
    model = torch.nn.Sequential()
    model.add_module("fc1", fc1)
    inspector = TensorInspector(model, layers="fc1", tensors=("activation",), every=1)
    x = torch.randn(3, 8)
    with inspector.step(1):
        fc1(input=x)
    (rec,) = inspector.history
    assert_stats_close(rec, reference_stats(x))


def test_an_empty_microbatch_does_not_hide_the_extremes_of_the_others() -> None:
    t = torch.tensor([1.0, -2.0, 5.0])
    rows = [partial_stats(torch.empty(0)).tolist(), partial_stats(t).tolist()]
    got = combine_partials(rows, SUPPORTED_STATS)
    assert_stats_close(got, reference_stats(t))
    empty = combine_partials(rows[:1], ("min", "max", "nan_count"))
    assert math.isnan(empty["min"]) and math.isnan(empty["max"]) and empty["nan_count"] == 0


def test_a_skipped_pair_records_nothing_so_no_record_mixes_two_tensors() -> None:
    """Under the TE backend a LayerNorm+Linear's "activation" is TE's normalised GEMM input; the
    hooks, which see the module input, skip that pair instead of merging counts of another tensor."""
    from accounting.inspector.hooks import HookRecorder
    from accounting.inspector.nvdlfw import normalises_its_input

    model = TinyMLP()
    fused = model.layers[0].fc1
    # The attribute TE's LayerNormLinear/LayerNormMLP hold their norm's weight in (TE 2.6).
    fused.register_parameter("layer_norm_weight", torch.nn.Parameter(torch.ones(8)))
    modules = {n: m for n, m in layer_names(model).items() if n.endswith("fc1")}
    skip = frozenset((n, "activation") for n, m in modules.items() if normalises_its_input(m))
    assert skip == {("model.layers.1.fc1", "activation")}
    recorder = HookRecorder(modules, ("activation", "weight"), skip)
    recorder.attach()
    train_step(model)
    rows = recorder.detach()
    assert set(rows) == {
        ("model.layers.1.fc1", "weight"),
        ("model.layers.2.fc1", "activation"),
        ("model.layers.2.fc1", "weight"),
    }


def test_no_accounting_module_shadows_a_stdlib_module() -> None:
    """`accounting/inspect.py` shadowed the stdlib's `inspect` whenever `accounting/` was on
    sys.path (`python accounting/seqlens.py` failed inside `dataclasses`); the package is now
    `accounting.inspector`, and no module of the library may take a stdlib name again."""
    import pkgutil
    import sys

    import accounting

    ours = {m.name.rsplit(".", 1)[-1] for m in pkgutil.walk_packages(accounting.__path__, "accounting.")}
    assert "inspector" in ours
    assert ours & set(sys.stdlib_module_names) == set()
