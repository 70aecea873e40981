"""Memory sizes and the `memory_budget` marker's value: parsing, formatting, clear errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from megatron_testkit.budgets import MemoryBudget, format_size, parse_size

pytestmark = pytest.mark.L0

UNITS = {
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1.5GiB", 1536 * 2**20),
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("2 gb", 2 * 10**9),
        ("100", 100),
        (".5KiB", 512),
        (4096, 4096),
        (None, None),
    ],
)
def test_documented_sizes_parse_to_bytes(text: str | int | None, expected: int | None) -> None:
    assert parse_size(text) == expected


@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(sorted(UNITS)))
def test_integer_sizes_in_every_unit_are_exact(number: int, unit: str) -> None:
    assert parse_size(f"{number}{unit}") == number * UNITS[unit]
    assert parse_size(f"{number} {unit.lower()}") == number * UNITS[unit]


@given(st.integers(min_value=1, max_value=2**50))
def test_formatted_sizes_parse_back_within_rounding(size: int) -> None:
    text = format_size(size).replace(" ", "")
    # Below 1 KiB the bytes are exact. Above, two decimals of a value v >= 1 in its unit are off by
    # at most 0.005 units, i.e. 0.005 / v <= 0.5% of the size; parse_size then truncates to whole
    # bytes, which loses less than one more byte (size=1070: "1.04KiB" is 1064.96 B, read as 1064).
    assert abs(parse_size(text) - size) <= size * 0.005 + 1


def test_the_size_that_exposed_the_truncated_byte_parses_back_within_the_bound() -> None:
    assert format_size(1070) == "1.04 KiB"
    assert parse_size("1.04KiB") == 1064  # 1.04 * 1024 = 1064.96, truncated
    assert 1070 - 1064 <= 1070 * 0.005 + 1


@given(
    st.integers(min_value=1, max_value=2**50),
    st.one_of(
        st.integers(min_value=-(2**20), max_value=2**20), st.integers(min_value=-(2**50), max_value=2**50)
    ),
)
def test_a_size_and_its_budget_never_print_equal_when_they_differ(size: int, delta: int) -> None:
    budget = size + delta
    assume(budget >= 1 and budget != size)
    shown, limit = format_size(size, other=budget), format_size(budget, other=size)
    assert shown != limit  # "RSS x > budget y": x and y read differently whenever they differ
    # Only a collision adds the exact bytes, so tables and messages stay readable otherwise.
    if format_size(size) != format_size(budget):
        assert (shown, limit) == (format_size(size), format_size(budget))
    else:
        assert (shown, limit) == (f"{format_size(size)} ({size} B)", f"{format_size(budget)} ({budget} B)")


def test_the_reported_collision_reads_differently() -> None:
    # A peak one byte over a 2 GiB budget used to read "RSS 2.00 GiB > budget 2.00 GiB".
    budget = 2 * 2**30
    assert format_size(budget + 1, other=budget) == "2.00 GiB (2147483649 B)"
    assert format_size(budget, other=budget + 1) == "2.00 GiB (2147483648 B)"
    assert format_size(budget, other=budget) == "2.00 GiB"  # equal sizes read equal, without bytes
    assert format_size(None, other=budget) == "-"


def test_the_exception_named_in_budget_messages_is_importable_under_that_name() -> None:
    import megatron_testkit
    from megatron_testkit import budgets, diagnosis, ranks

    # rank_worker writes this name into a rank's record when its watchdog stops the rank.
    assert megatron_testkit.MemoryBudgetExceeded is budgets.MemoryBudgetExceeded
    assert issubclass(megatron_testkit.MemoryBudgetExceeded, MemoryError)
    assert megatron_testkit.RankFailure is diagnosis.RankFailure is ranks.RankFailure
    assert megatron_testkit.run_ranks is ranks.run_ranks
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        megatron_testkit.nothing_here  # noqa: B018


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("lots", "cannot parse memory size 'lots'"),
        ("1.5 GiBs", "unknown unit 'GiBs'"),
        ("GiB", "cannot parse"),
        ("-1GiB", "cannot parse"),
        ("0MiB", "must be positive"),
        (0, "must be positive"),
        (0.5, "must be positive"),
        (float("inf"), "must be positive"),
        (float("nan"), "must be positive"),
        (True, "got True"),
        ([1], "got [1]"),
    ],
)
def test_garbage_sizes_raise_value_error_saying_what_was_given(value: object, says: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        parse_size(value)  # type: ignore[arg-type]
    assert says in str(info.value)


def test_budget_from_marker_keywords() -> None:
    mark = SimpleNamespace(args=(), kwargs={"host": "1.5GiB", "device": "4GiB"})
    budget = MemoryBudget.from_marker(mark)
    assert budget == MemoryBudget(host_bytes=1536 * 2**20, device_bytes=4 * 2**30)
    assert budget.describe() == "host 1.50 GiB, device 4.00 GiB"
    assert MemoryBudget().describe() == "-"


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        (("1GiB",), {}, "keywords only"),
        ((), {"hots": "1GiB"}, "unknown keyword(s) ['hots']"),
        ((), {"host": "a lot"}, "cannot parse memory size 'a lot'"),
    ],
)
def test_bad_marker_arguments_are_named(args: tuple, kwargs: dict, says: str) -> None:
    with pytest.raises(ValueError) as info:
        MemoryBudget.from_marker(SimpleNamespace(args=args, kwargs=kwargs))
    assert says in str(info.value)


def test_format_size_picks_a_readable_unit() -> None:
    assert format_size(None) == "-"
    assert format_size(512) == "512 B"
    assert format_size(600 * 2**20) == "600.00 MiB"
    assert format_size(3 * 2**40) == "3072.00 GiB"


@pytest.mark.parametrize(
    ("budget", "card", "expected"),
    [
        (None, None, None),
        (4 * 2**30, None, 4 * 2**30),
        (None, "40GiB", 40 * 2**30),
        (4 * 2**30, "40GiB", 4 * 2**30),
        (80 * 2**30, "40GiB", 40 * 2**30),
    ],
)
def test_device_cap_is_the_smaller_of_budget_and_emulated_card(monkeypatch, budget, card, expected):
    from megatron_testkit.rank_worker import device_cap

    if card is None:
        monkeypatch.delenv("KIT_DEVICE_MEMORY", raising=False)
    else:
        monkeypatch.setenv("KIT_DEVICE_MEMORY", card)
    assert device_cap(budget) == expected


def test_a_peak_over_its_budget_is_named_in_one_message_for_every_checker() -> None:
    from megatron_testkit.budgets import MemoryBudgetExceeded, check_peaks

    check_peaks(100, None, 100, 50)  # at the budget, and a device never used: within
    check_peaks(None, 10, 1, None)  # an unknown host peak, an unlimited device: within
    with pytest.raises(MemoryBudgetExceeded) as host:
        check_peaks(3 << 20, 9 << 20, 2 << 20, 1 << 20)  # both over: the host is named first
    assert str(host.value) == "host memory budget exceeded: peak RSS 3.00 MiB > budget 2.00 MiB"
    with pytest.raises(MemoryBudgetExceeded) as device:
        check_peaks(1, 3 << 20, 2 << 20, 2 << 20, since=" since the call", note=" (torchrun)")
    assert str(device.value) == (
        "device memory budget exceeded: peak allocated 3.00 MiB since the call > budget 2.00 MiB (torchrun)"
    )
