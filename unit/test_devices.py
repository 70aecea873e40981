"""megatron_testkit.devices: backend choice, device hiding, memory caps and the GPU gate per rank.

Each decision is checked against its rule restated here, not
against the module's own arithmetic. The GPU variants run the real thing on CUDA (a hidden
device, a lazily applied cap) and skip with their reason on a CPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_testkit import devices, skips

pytestmark = pytest.mark.L0

GiB = 1024**3


# ---- a test not marked gpu never gets NCCL --------------------------------------------------------
@given(world_size=st.integers(1, 16), gpus=st.integers(0, 16))
def test_auto_gives_a_test_not_marked_gpu_gloo_whatever_the_gpus(world_size, gpus):
    assert devices.choose_backend("auto", world_size, gpus=gpus, gpu_test=False) == "gloo"


@given(world_size=st.integers(1, 16), gpus=st.integers(0, 16), gpu_test=st.sampled_from([True, None]))
def test_auto_gives_a_gpu_test_or_a_plain_launch_nccl_exactly_when_every_rank_has_a_gpu(
    world_size, gpus, gpu_test
):
    expected = "nccl" if gpus >= world_size else "gloo"
    assert devices.choose_backend("auto", world_size, gpus=gpus, gpu_test=gpu_test) == expected


@given(
    requested=st.sampled_from(["gloo", "nccl"]),
    gpus=st.integers(0, 8),
    gpu_test=st.sampled_from([True, False, None]),
)
def test_an_explicit_backend_is_kept(requested, gpus, gpu_test):
    assert devices.choose_backend(requested, 2, gpus=gpus, gpu_test=gpu_test) == requested


def test_bad_backend_or_world_size_is_refused_with_what_was_given():
    with pytest.raises(ValueError, match=r"backend='mpi'"):
        devices.choose_backend("mpi", 2, gpus=2, gpu_test=True)
    with pytest.raises(ValueError, match=r"world_size must be >= 1, got 0"):
        devices.choose_backend("auto", 0, gpus=2, gpu_test=True)


@pytest.mark.parametrize(
    ("backend", "gpu_test", "hidden"),
    [
        ("gloo", False, True),  # the CPU tests on a GPU machine: as on the CPU runner
        ("gloo", True, False),  # a gpu test asking for gloo may still use CUDA tensors
        ("gloo", None, False),  # outside pytest: the caller's machine as it is
        ("nccl", False, False),  # asked for NCCL explicitly: it needs the devices
        ("nccl", True, False),
    ],
)
def test_devices_are_hidden_only_from_gloo_ranks_of_tests_not_marked_gpu(backend, gpu_test, hidden):
    env = devices.rank_device_env(backend, gpu_test=gpu_test)
    assert env == ({"CUDA_VISIBLE_DEVICES": ""} if hidden else {})


@pytest.mark.parametrize(
    ("backend", "gpu_test", "environ", "expected"),
    [
        ("nccl", None, {}, True),
        ("gloo", True, {}, True),
        ("gloo", False, {}, False),
        ("gloo", None, {}, False),
        ("nccl", True, {"CUDA_VISIBLE_DEVICES": ""}, False),
        ("gloo", True, {"CUDA_VISIBLE_DEVICES": "-1"}, False),
    ],
)
def test_a_rank_uses_cuda_with_nccl_or_in_a_gpu_test_unless_its_devices_are_hidden(
    backend, gpu_test, environ, expected
):
    assert devices.uses_cuda(backend, gpu_test=gpu_test, environ=environ) is expected


@pytest.mark.gpu
def test_a_hidden_rank_sees_no_cuda_device_on_a_gpu_machine():
    if not torch.cuda.is_available():
        skips.skip("cuda", "on a CPU machine every rank already sees no device")
    env = {**os.environ, **devices.rank_device_env("gloo", gpu_test=False)}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0"]


# ---- KIT_DEVICE_MEMORY must not create a CUDA context in gloo ranks -------------------------------
@pytest.mark.parametrize(
    ("budget", "card", "expected"),
    [
        (None, None, None),
        (2 * GiB, None, 2 * GiB),
        (None, "40GiB", 40 * GiB),
        (2 * GiB, "40GiB", 2 * GiB),  # the smaller of the two
        (80 * GiB, "40GiB", 40 * GiB),
    ],
)
def test_device_cap_is_the_smaller_of_the_budget_and_the_emulated_card(budget, card, expected):
    environ = {} if card is None else {"KIT_DEVICE_MEMORY": card}
    assert devices.device_memory_cap(budget, environ) == expected


def test_a_bad_emulated_card_size_names_the_variable():
    with pytest.raises(ValueError, match=r"KIT_DEVICE_MEMORY='forty'"):
        devices.device_memory_cap(None, {"KIT_DEVICE_MEMORY": "forty"})


def test_without_cuda_no_cap_is_applied_and_nothing_is_touched():
    if torch.cuda.is_available():
        skips.skip("no-cuda", "this machine has CUDA (see the gpu test)")
    assert devices.apply_device_cap(0, "gloo", 4 * GiB) == "none"
    assert devices.apply_device_cap(0, "nccl", None) == "none"
    assert not torch.cuda.is_initialized()


def test_a_gloo_rank_queues_its_cap_instead_of_creating_a_context(monkeypatch):
    """CUDA availability is simulated (no GPU here): any eager CUDA call would raise, so the test
    proves the gloo path only queues the cap with torch's lazy-init hook."""
    queued = []

    def eager(*args, **kwargs):
        raise AssertionError("a gloo rank must not touch CUDA for a memory cap")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("set_device", "get_device_properties", "set_per_process_memory_fraction", "init"):
        monkeypatch.setattr(torch.cuda, name, eager)
    monkeypatch.setattr(torch.cuda, "_lazy_call", queued.append)
    assert devices.apply_device_cap(3, "gloo", 4 * GiB) == "lazy"
    assert len(queued) == 1 and callable(queued[0])
    assert devices.apply_device_cap(3, "gloo", None) == "none"
    assert len(queued) == 1
    # When CUDA initialises (simulated: 2 devices of 80 GiB), rank 3 takes device 3 % 2 = 1 and
    # caps its allocator to 4/80 of it.
    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * GiB})()
    )
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append(("fraction", f, d))
    )
    queued[0]()
    assert calls == [("set_device", 1), ("fraction", 0.05, 1)]


_LAZY_CAP_PROBE = """
import torch
from megatron_testkit.devices import apply_device_cap
mode = apply_device_cap(0, "gloo", 1 << 30)
before = torch.cuda.is_initialized()
small = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # first touch: the cap applies
try:
    torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    capped = False
except torch.OutOfMemoryError:
    capped = True
print(mode, before, capped)
"""


@pytest.mark.gpu
def test_on_cuda_the_queued_cap_applies_at_the_first_touch_and_not_before():
    if not torch.cuda.is_available():
        skips.skip("cuda", "the cap applies to a real CUDA device")
    out = subprocess.run([sys.executable, "-c", _LAZY_CAP_PROBE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lazy", "False", "True"]


# ---- host budgets of CUDA ranks ---------------------------------------------------------------------
def test_a_cpu_rank_keeps_its_budget_and_no_budget_stays_none():
    assert devices.host_budget(512 * 2**20, cuda=False, environ={}) == 512 * 2**20
    assert devices.host_budget(None, cuda=True, environ={}) is None


def test_a_cuda_rank_gets_the_allowance_on_top_of_its_test_budget():
    assert devices.host_budget(768 * 2**20, cuda=True, environ={}) == 768 * 2**20 + 4 * GiB
    override = {"KIT_CUDA_HOST_ALLOWANCE": "2.5GiB"}
    assert devices.host_budget(GiB, cuda=True, environ=override) == GiB + 5 * GiB // 2
    with pytest.raises(ValueError, match=r"KIT_CUDA_HOST_ALLOWANCE='lots'"):
        devices.host_budget(GiB, cuda=True, environ={"KIT_CUDA_HOST_ALLOWANCE": "lots"})


@pytest.mark.parametrize(
    ("backend", "gpu_test", "environ", "allowance"),
    [
        ("nccl", True, {}, 4 * GiB),  # the te-nvdlfw tensor-inspect ranks: CUDA context, NCCL, TE
        ("gloo", True, {}, 4 * GiB),  # a gpu test's gloo rank may use CUDA too
        ("gloo", False, {"CUDA_VISIBLE_DEVICES": ""}, 0),  # what a test not marked gpu gets
        ("nccl", True, {"CUDA_VISIBLE_DEVICES": ""}, 0),  # hidden devices: never a CUDA rank
        ("nccl", True, {"KIT_CUDA_HOST_ALLOWANCE": "1GiB"}, GiB),
    ],
)
def test_a_ranks_host_limit_is_its_budget_plus_the_allowance_exactly_when_it_may_use_cuda(
    backend, gpu_test, environ, allowance
):
    # The function the rank worker applies, and the one a test asserts a rank's peak against.
    assert devices.rank_host_budget(768 * 2**20, backend, gpu_test=gpu_test, environ=environ) == (
        768 * 2**20 + allowance
    )
    assert devices.rank_host_budget(None, backend, gpu_test=gpu_test, environ=environ) is None


def test_the_rank_worker_holds_its_rank_to_rank_host_budget():
    # One source for the launcher's limit: the worker calls rank_host_budget, so a test asserting
    # against it asserts the same limit the watchdog enforces.
    import inspect

    from megatron_testkit import rank_worker

    assert "devices.rank_host_budget(" in inspect.getsource(rank_worker._watch)


# ---- a rank names its own device ---------------------------------------------------------------------
def test_a_rank_that_never_used_cuda_names_no_device():
    # This process has not initialised CUDA (a CPU rank); the name must not initialise it either.
    assert not torch.cuda.is_initialized()
    assert devices.rank_device_name() is None
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
def test_on_cuda_a_rank_names_its_own_device_after_cuda_visible_devices():
    if not torch.cuda.is_available():
        skips.skip("cuda", "names a real CUDA device")
    # The last visible GPU as the only one: the name must be that GPU's, as nvidia-smi -i 0 is not.
    last = torch.cuda.device_count() - 1
    probe = (
        "import torch; from megatron_testkit import devices; torch.cuda.set_device(0); "
        "print(devices.rank_device_name())"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(last)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == torch.cuda.get_device_name(last)


# ---- KIT_REQUIRE_GPUS turns a GPU skip into a failure -----------------------------------------------
def test_required_gpus_parses_and_refuses_nonsense():
    assert devices.required_gpus({}) == 0
    assert devices.required_gpus({"KIT_REQUIRE_GPUS": " 2 "}) == 2
    with pytest.raises(ValueError, match=r"KIT_REQUIRE_GPUS='two'"):
        devices.required_gpus({"KIT_REQUIRE_GPUS": "two"})
    with pytest.raises(ValueError, match=r"KIT_REQUIRE_GPUS='-1'.*>= 0"):
        devices.required_gpus({"KIT_REQUIRE_GPUS": "-1"})


@given(visible=st.integers(0, 8), need=st.one_of(st.none(), st.integers(1, 8)), required=st.integers(0, 8))
def test_gpu_gate_runs_with_enough_fails_when_promised_and_skips_otherwise(visible, need, required):
    wanted = 1 if need is None else need
    gate = devices.gpu_gate(visible, need, required)
    if visible >= wanted:
        assert gate == devices.GpuGate("run")
        return
    assert gate.action == ("fail" if required >= wanted else "skip")
    # The plugin's skip reasons, word for word (functional/test_launcher_plugin.py matches them).
    if visible == 0:
        assert gate.reason.startswith("needs CUDA (marked gpu); no CUDA device is visible")
    else:
        assert gate.reason.startswith(
            f"needs {wanted} GPUs (marked gpu, world_size({wanted})); {visible} visible"
        )
    assert ("KIT_REQUIRE_GPUS" in gate.reason) is (gate.action == "fail")
    if gate.action == "fail":
        assert f"KIT_REQUIRE_GPUS={required} promises {required}" in gate.reason


def test_gpu_gate_refuses_a_world_size_below_one():
    with pytest.raises(ValueError, match=r"world_size\(0\)"):
        devices.gpu_gate(2, 0, 2)
