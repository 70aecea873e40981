"""IntervalThroughput: interval deltas over an injected clock, per-GPU TFLOP/s, MFU, resume without spikes."""

from __future__ import annotations

import json
import logging
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting import IntervalThroughput
from accounting.throughput import PEAK_FLOPS, device_key, peak_flops

pytestmark = pytest.mark.L0


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_interval_reports_delta_over_elapsed_per_gpu():
    clock = FakeClock()
    meter = IntervalThroughput(8, peak_flops_per_gpu=4e12, clock=clock)
    clock.now += 0.5
    report = meter.log(8e12, total_tokens=4096)
    assert report.elapsed_s == 0.5 and report.flops == 8 * 10**12
    assert report.tflops_per_gpu == pytest.approx(2.0)  # 8e12 / 0.5 s / 8 GPUs
    assert report.mfu == pytest.approx(0.5)
    assert report.tokens_per_s == pytest.approx(8192) and report.tokens_per_s_per_gpu == pytest.approx(1024)


def test_resuming_from_a_checkpointed_counter_does_not_spike():
    clock = FakeClock()
    restored = 10**21  # cumulative FLOPs saved in the checkpoint
    meter = IntervalThroughput(2, start_flops=restored, start_tokens=10**9, clock=clock)
    clock.now += 2.0
    report = meter.log(restored + 4 * 10**12, total_tokens=10**9 + 100)
    assert report.flops == 4 * 10**12 and report.tflops_per_gpu == pytest.approx(1.0)
    assert report.tokens == 100 and report.mfu is None


@given(
    st.lists(st.tuples(st.integers(0, 10**15), st.floats(0.01, 100.0)), min_size=1, max_size=10),
    st.integers(1, 64),
)
def test_intervals_partition_the_cumulative_counter_and_the_wall_time(steps, world_size):
    clock = FakeClock(0.0)
    meter = IntervalThroughput(world_size, clock=clock)
    total, reports = 0, []
    for flops, seconds in steps:
        total += flops
        clock.now += seconds
        reports.append(meter.log(total))
    assert sum(r.flops for r in reports) == total
    assert sum(r.elapsed_s for r in reports) == pytest.approx(clock.now)
    for (flops, seconds), r in zip(steps, reports, strict=True):
        assert r.tflops_per_gpu == pytest.approx(flops / seconds / world_size / 1e12)


def test_a_counter_that_goes_backwards_gives_an_empty_interval_and_re_anchors():
    clock = FakeClock()
    meter = IntervalThroughput(1, start_flops=100, clock=clock)
    clock.now += 1
    assert meter.log(50).flops == 0
    clock.now += 1
    assert meter.log(80).flops == 30


def test_zero_elapsed_time_reports_zero_rates_instead_of_dividing_by_zero():
    clock = FakeClock()
    meter = IntervalThroughput(1, device_name="NVIDIA A100-SXM4-80GB", clock=clock)
    report = meter.log(10)
    assert report.tflops_per_gpu == 0.0 and report.mfu == 0.0


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
        ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H200", "bf16", 989.4e12),
        ("NVIDIA H200", "fp8", 1978.9e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA B200", "fp8", 4500e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "torch.bfloat16", 312e12),
    ],
)
def test_peak_table_gives_dense_vendor_peaks(device, dtype, expected):
    assert peak_flops(device, dtype) == expected


def test_fp8_peaks_double_bf16_and_no_entry_is_a_sparse_figure():
    for (device, dtype), value in PEAK_FLOPS.items():
        if dtype == "fp8":
            assert value == pytest.approx(2 * PEAK_FLOPS[(device, "bf16")], rel=1e-3)
    assert PEAK_FLOPS[("H100", "bf16")] < 1000e12  # the sparse figure is 1979


@pytest.mark.parametrize(
    ("device", "dtype"), [("NVIDIA A100-SXM4-80GB", "fp8"), ("Tesla V100", "bf16"), ("NVIDIA H100", "fp4")]
)
def test_unknown_device_or_dtype_is_refused(device, dtype):
    with pytest.raises(ValueError, match="peak"):
        peak_flops(device, dtype)


def test_world_size_must_be_positive():
    with pytest.raises(ValueError, match="world_size"):
        IntervalThroughput(0)


@pytest.mark.parametrize("peak", [0, -1e12, float("nan"), float("inf"), "989e12", True])
def test_peak_must_be_a_positive_finite_number(peak):
    # 0 silently gave mfu None, a negative peak a negative MFU.
    with pytest.raises(ValueError, match="peak_flops_per_gpu"):
        IntervalThroughput(1, peak_flops_per_gpu=peak)


@pytest.mark.parametrize("device", ["NVIDIA RTX A1000 Laptop GPU"])
def test_devices_the_table_does_not_describe_are_refused_not_matched_by_substring(device):
    # "A1000" contains "A100".
    with pytest.raises(ValueError, match="no peak FLOP/s known for device"):
        peak_flops(device, "bf16")


@pytest.mark.parametrize(
    ("device", "key", "sxm"),
    [
        ("NVIDIA H100 NVL", "H100 NVL", "NVIDIA H100 80GB HBM3"),
        ("NVIDIA H200 NVL", "H200 NVL", "NVIDIA H200"),
        ("NVIDIA H100 PCIe", "H100 PCIe", "NVIDIA H100 80GB HBM3"),
    ],
)
def test_nvl_and_pcie_parts_get_their_own_datasheet_peaks_never_the_sxm_figure(device, key, sxm):
    # The H100/H200 NVL and the H100 PCIe run below the SXM part of the same model (their
    # datasheets' own columns): matched as the SXM part, MFU would read 15-25% low. Before, the
    # NVL parts were refused (no MFU at all).
    assert device_key(device) == key and device_key(sxm) == key.split()[0]
    for dtype in ("bf16", "fp8"):
        assert peak_flops(device, dtype) < peak_flops(sxm, dtype)
    assert peak_flops("NVIDIA H100 NVL") == peak_flops("NVIDIA H200 NVL") == 835.5e12  # 1,671 sparse / 2


def test_the_a100s_pcie_part_shares_the_sxm_key_because_its_peak_is_the_same():
    assert device_key("NVIDIA A100-PCIE-40GB") == device_key("NVIDIA A100-SXM4-80GB") == "A100"


# ------------------------------------------------------------- the accelerators users run now


@pytest.mark.parametrize(
    ("device", "dtype", "expected"),
    [
        # Names as torch.cuda.get_device_name() gives them (ROCm builds report AMD's names).
        ("NVIDIA B300 SXM6 AC", "bf16", 2250e12),
        ("NVIDIA B300 SXM6 AC", "fp8", 4500e12),
        ("NVIDIA GB200", "bf16", 2500e12),
        ("NVIDIA GB200", "fp8", 5000e12),
        ("NVIDIA GB300", "bf16", 2500e12),
        ("NVIDIA GB300", "fp8", 5000e12),
        ("NVIDIA GH200 480GB", "bf16", 989.4e12),
        ("NVIDIA L40S", "bf16", 366.5e12),
        ("NVIDIA L40S", "fp8", 733e12),
        ("AMD Instinct MI300X", "bf16", 1307.4e12),
        ("AMD Instinct MI300X VF", "fp8", 2614.9e12),
        ("AMD Instinct MI325X", "bf16", 1307.4e12),
        ("AMD Instinct MI325X", "fp8", 2614.9e12),
        ("AMD Instinct MI355X", "bf16", 2516.6e12),
        ("AMD Instinct MI355X", "fp8", 5033.2e12),
    ],
)
def test_new_accelerators_give_their_dense_datasheet_peaks(device, dtype, expected):
    assert peak_flops(device, dtype) == expected


def test_a_grace_superchip_is_not_matched_as_the_gpu_inside_its_name():
    # "GB200" contains "B200", "GH200" contains "H200": whole model numbers only. The GB200's
    # Blackwell runs at a higher power than the HGX B200's, so the two peaks differ.
    assert device_key("NVIDIA GB200") == "GB200" and device_key("NVIDIA B200") == "B200"
    assert peak_flops("NVIDIA GB200") != peak_flops("NVIDIA B200")
    assert device_key("NVIDIA GH200 480GB") == "GH200"


@pytest.mark.parametrize("device", ["NVIDIA L40", "AMD Instinct MI300A", "AMD Instinct MI250X", "NVIDIA H20"])
def test_neighbouring_parts_with_other_peaks_are_not_matched(device):
    # The L40 runs at half the L40S's BF16, the MI300A (an APU) below the MI300X, the H20 far below
    # the H100/H200: a near-miss match would make MFU wrong by that factor.
    assert device_key(device) is None


def test_every_table_entry_names_its_datasheet_source():
    import inspect

    from accounting import throughput

    comments = " ".join(
        line.lstrip("# ") for line in inspect.getsource(throughput).splitlines() if line.startswith("#")
    )
    bullets = {b.split()[0].rstrip(":"): b for b in comments.split(" - ")[1:]}
    for device in {key for key, _ in PEAK_FLOPS}:
        bullet = bullets.get(device.split()[0], "")
        assert re.search(r"datasheet|specifications", bullet), f"{device}: no source in {bullet!r}"


# --------------------------------------------------------------- MFU never stops training


def test_an_unknown_device_gives_mfu_none_and_one_logged_reason_not_an_error(caplog):
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="accounting.throughput"):
        meter = IntervalThroughput(8, device_name="Tesla V100-SXM2-32GB", clock=clock)
        reports = []
        for _ in range(3):
            clock.now += 1
            reports.append(meter.log(10**12 * len(reports)))
    assert all(r.mfu is None and r.peak_flops_per_gpu is None for r in reports)
    assert all(r.tflops_per_gpu >= 0 for r in reports)  # throughput is still reported
    assert "Tesla V100-SXM2-32GB" in meter.mfu_unavailable
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Tesla V100-SXM2-32GB" in warnings[0].getMessage()


def test_an_unknown_dtype_gives_mfu_none_and_a_reason_naming_that_device_and_dtype(caplog):
    with caplog.at_level(logging.WARNING, logger="accounting.throughput"):
        meter = IntervalThroughput(1, device_name="NVIDIA H100 80GB HBM3", dtype="fp32", clock=FakeClock())
    reason = meter.mfu_unavailable
    assert "fp32" in reason and "H100" in reason and "A100" not in reason and "FP8" not in reason
    assert meter.peak_flops_per_gpu is None and len(caplog.records) == 1


def test_the_strict_lookup_names_the_device_and_dtype_it_was_asked_about():
    with pytest.raises(
        ValueError, match=r"no fp32 peak FLOP/s known for H100; the table holds bf16, fp8"
    ) as err:
        peak_flops("NVIDIA H100 80GB HBM3", "fp32")
    assert "A100" not in str(err.value)
    with pytest.raises(
        ValueError, match=r"no fp8 peak FLOP/s known for A100 \(the A100 has no FP8 tensor cores\)"
    ):
        peak_flops("NVIDIA A100-SXM4-80GB", "fp8")


def test_the_report_carries_the_device_and_the_peak_used():
    clock = FakeClock()
    meter = IntervalThroughput(2, device_name="NVIDIA H100 PCIe", dtype="fp8", clock=clock)
    clock.now += 1
    report = meter.log(1513 * 10**12)
    assert (report.device, report.dtype, report.peak_flops_per_gpu) == ("H100 PCIe", "fp8", 1513e12)
    assert report.mfu == pytest.approx(0.5) and not report.mfu_over_one
    given = IntervalThroughput(1, peak_flops_per_gpu=4e12, clock=clock).log(0)
    assert given.peak_flops_per_gpu == 4e12 and given.device is None


@pytest.mark.parametrize(("flops", "flagged"), [(10**12, False), (4 * 10**12, False), (4 * 10**12 + 1, True)])
def test_an_interval_above_the_peak_is_flagged_and_logged_as_a_likely_over_count(caplog, flops, flagged):
    clock = FakeClock()
    meter = IntervalThroughput(1, peak_flops_per_gpu=4e12, clock=clock)
    clock.now += 1.0
    with caplog.at_level(logging.WARNING, logger="accounting.throughput"):
        report = meter.log(flops)
    assert report.mfu == pytest.approx(flops / 4e12)
    assert report.mfu_over_one is flagged
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == int(flagged)
    if flagged:
        assert "over-counted" in warnings[0]


# --------------------------------------------------------------- MFU under mixed precision

H100 = "NVIDIA H100 80GB HBM3"  # datasheet dense peaks: BF16 989.4, FP8 1978.9 TFLOP/s


def test_mfu_by_precision_is_each_terms_time_at_its_own_peak_over_the_interval():
    # Hand computation: 4 GPUs for 2 s; the linear layers' 6e15 FLOPs in FP8, attention's 1e15 and
    # the logits' 0.5e15 in BF16 (a TE FP8 recipe):
    #   MFU = (6e15 / 1978.9e12 + 1.5e15 / 989.4e12) / (2 x 4) = (3.03199 + 1.51607) / 8 = 0.568508
    # beside the single BF16-peak MFU 7.5e15 / (2 x 4 x 989.4e12) = 0.947544.
    clock = FakeClock()
    meter = IntervalThroughput(4, device_name=H100, precision="tensorwise", clock=clock)
    terms = {
        "attention_projections": 2 * 10**15,
        "mlp": 4 * 10**15,
        "core_attention": 10**15,
        "logits": 5 * 10**14,
    }
    clock.now += 2.0
    report = meter.log(sum(terms.values()), terms=terms)
    assert report.mfu == pytest.approx(0.568508, rel=1e-5)
    assert report.mfu_basis == "by precision" and report.peaks == {"fp8": 1978.9e12, "bf16": 989.4e12}
    assert report.mfu_single_peak == pytest.approx(0.947544, rel=1e-5) and report.dtype == "bf16"
    # A mapping says the same as the recipe; a term's own entry wins over its group's.
    same = IntervalThroughput(4, device_name=H100, precision={"linear": "fp8"}, clock=clock)
    clock.now += 2.0
    assert same.log(sum(terms.values()), terms=terms).mfu == pytest.approx(report.mfu)
    override = IntervalThroughput(
        4, device_name=H100, precision={"linear": "fp8", "mlp": "bf16"}, clock=clock
    )
    clock.now += 2.0
    # (2e15 / 1978.9e12 + 5.5e15 / 989.4e12) / 8 = (1.01066 + 5.55892) / 8 = 0.821198
    assert override.log(sum(terms.values()), terms=terms).mfu == pytest.approx(0.821198, rel=1e-5)


def test_one_precision_gives_todays_single_peak_mfu():
    clock = FakeClock()
    terms = {"mlp": 3 * 10**15, "core_attention": 10**15}
    plain = IntervalThroughput(2, device_name=H100, dtype="fp8", clock=clock)
    weighted = IntervalThroughput(2, device_name=H100, dtype="fp8", precision="fp8", clock=clock)
    clock.now += 1.5
    a, b = plain.log(4 * 10**15, terms=terms), weighted.log(4 * 10**15, terms=terms)
    assert b.mfu == pytest.approx(a.mfu) == pytest.approx(4e15 / (1.5 * 2 * 1978.9e12))
    assert a.mfu_basis == "single peak" and a.mfu_single_peak == a.mfu


def test_intervals_by_precision_take_the_deltas_of_the_cumulative_terms_and_resume_without_a_spike():
    clock = FakeClock()
    restored = {"mlp": 10**20, "core_attention": 10**19}
    meter = IntervalThroughput(
        1,
        device_name=H100,
        precision="delayed",
        start_flops=sum(restored.values()),
        start_terms=restored,
        clock=clock,
    )
    clock.now += 1.0
    now = {"mlp": 10**20 + 9_894_500 * 10**8, "core_attention": 10**19 + 24_735 * 10**10}  # exact ints
    report = meter.log(sum(now.values()), terms=now)
    assert report.mfu == pytest.approx(0.5 + 0.25)  # half a second of FP8 work, a quarter of BF16


@pytest.mark.parametrize(
    ("device", "precision", "terms", "reason"),
    [
        (H100, {"attention": "fp4"}, {"core_attention": 10**12}, "core_attention runs in fp4: no fp4 peak"),
        ("NVIDIA A100-SXM4-80GB", "tensorwise", {"mlp": 10**12}, "the A100 has no FP8 tensor cores"),
        ("Tesla V100-SXM2-32GB", "tensorwise", {"mlp": 10**12}, "no peak FLOP/s known for device"),
        (H100, "tensorwise", None, "needs log(..., terms=acc.total_terms)"),
        (H100, "tensorwise", {"mlp": 10**12 - 1}, "do not add up to the interval's"),
        (None, "tensorwise", {"mlp": 10**12}, "needs device_name="),
    ],
)
def test_an_unknown_precision_or_device_gives_no_mfu_with_the_reason(
    caplog, device, precision, terms, reason
):
    clock = FakeClock()
    peak = None if device is not None else 1e15
    with caplog.at_level(logging.WARNING, logger="accounting.throughput"):
        meter = IntervalThroughput(
            1, device_name=device, peak_flops_per_gpu=peak, precision=precision, clock=clock
        )
        for _ in range(2):
            clock.now += 1.0
            report = meter.log(
                10**12 * (1 + _), terms=None if terms is None else {k: v * (1 + _) for k, v in terms.items()}
            )
    assert report.mfu is None and reason in report.mfu_unavailable
    assert any(reason in r.getMessage() for r in caplog.records)
    assert report.tflops_per_gpu > 0  # throughput is still reported


def test_a_precision_for_a_term_the_model_does_not_run_changes_nothing():
    clock = FakeClock()
    meter = IntervalThroughput(
        1, device_name=H100, precision={"mamba_scan": "fp4", "linear": "fp8"}, clock=clock
    )
    clock.now += 1.0
    report = meter.log(10**15, terms={"mlp": 10**15, "mamba_scan": 0})
    assert report.mfu == pytest.approx(1e15 / 1978.9e12)


def test_an_unknown_group_or_term_is_a_configuration_error():
    with pytest.raises(ValueError, match="precision key 'linaer' is neither a term group"):
        IntervalThroughput(1, device_name=H100, precision={"linaer": "fp8"})


def test_every_flops_term_belongs_to_exactly_one_precision_group():
    from accounting.flops import TERMS
    from accounting.precisions import GROUPS

    grouped = [term for terms in GROUPS.values() for term in terms]
    assert sorted(grouped) == sorted(TERMS)


def test_flops_json_gives_the_time_at_each_precisions_peak(capsys):
    from accounting.cli import main

    argv = ["flops", "--preset", "llama3-8b", "--seq-len", "8192", "--device", H100, "--json"]
    assert main([*argv, "--precision", "linear=fp8,attention=bf16"]) == 0
    out = json.loads(capsys.readouterr().out)
    terms, at_peak = out["terms"], out["at_peak"]
    linear = terms["attention_projections"] + terms["mlp"]
    bf16 = terms["core_attention"] + terms["logits"]
    assert at_peak["seconds_at_peak"] == pytest.approx(linear / 1978.9e12 + bf16 / 989.4e12)
    assert at_peak["seconds_at_single_peak"] == pytest.approx(out["model_flops"] / 989.4e12)
    assert at_peak["precision"]["core_attention"] == "bf16" and at_peak["precision"]["mlp"] == "fp8"
    assert main([*argv[:-1], "--precision", "tensorwise"]) == 0
    assert "s by precision" in capsys.readouterr().out
    assert main(["flops", "--preset", "llama3-8b", "--seq-len", "8", "--precision", "fp8"]) == 2
    assert "--precision needs --device" in capsys.readouterr().err
