"""Per-rank memory budgets: size parsing and the `memory_budget` marker's value.

A budget is data (a frozen dataclass). The launcher enforces it inside each rank
(`megatron_testkit.rank_worker`); this module only parses and formats sizes and names the
exception of an overrun, so it is pure and cheap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float | None) -> int | None:
    """Bytes from a size such as ``"1.5GiB"``, ``"512MiB"``, ``"2GB"``, ``1024`` or ``None``.

    Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of
    1000, as on the labels of the machines the budgets describe. Anything else raises ValueError
    saying what was given and what is accepted.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory size must be a number of bytes or a string like '1.5GiB', got {value!r}")
    if isinstance(value, (int, float)):
        # NaN fails `value >= 1`; below one byte int() would give a 0-byte budget; inf has no int.
        if not 1 <= value < float("inf"):
            raise ValueError(
                f"memory size must be positive (a finite number of bytes, at least 1), got {value!r}"
            )
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"memory size must be a number of bytes or a string like '1.5GiB', got {value!r}")
    match = _SIZE.match(value)
    if match is None:
        raise ValueError(
            f"cannot parse memory size {value!r}: expected a number and a unit, e.g. '1.5GiB', '512MiB', '2GB'"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown unit {match.group(2)!r} in memory size {value!r}: use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        )
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


def parse_setting(name: str, raw: str) -> int:
    """A size given in the setting ``name`` (an environment variable), in bytes; ValueError naming
    the setting and its value, e.g. ``KIT_HOST_MEMORY='lots': cannot parse memory size ...``."""
    try:
        size = parse_size(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None
    assert size is not None
    return size


def format_size(size: int | float | None, other: int | float | None = None) -> str:
    """``1610612736`` -> ``"1.50 GiB"``; ``None`` -> ``"-"`` (for tables and messages).

    Bytes below 1 KiB, else two decimals in the largest binary unit up to GiB (within 0.5% of
    the size). ``other`` is the size printed beside this one (a budget beside a peak, or the peak
    beside its budget): when the two differ but would read the same, the exact byte count
    follows, ``"2.00 GiB (2147483649 B)"``, so that "RSS x > budget y" never shows x equal to y.
    """
    if size is None:
        return "-"
    text = _readable(size)
    if other is not None and other != size and _readable(other) == text:
        return f"{text} ({int(size)} B)"
    return text


def _readable(size: int | float) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class MemoryBudgetExceeded(MemoryError):
    """A rank's peak memory went over its ``memory_budget``; the launch fails with kind ``oom``.

    The name a rank's record and `RankFailure`'s message give when the kit stops a rank for its
    budget (``megatron_testkit.MemoryBudgetExceeded``). A `MemoryError`, so code that handles
    running out of memory handles running out of budget the same way.
    """


def check_peaks(
    host: int | None,
    device: int | None,
    budget_host: int | None,
    budget_device: int | None,
    *,
    since: str = "",
    note: str = "",
) -> None:
    """`MemoryBudgetExceeded` when a peak went over its budget, the host's first (None: unknown
    or unlimited). The one message of a rank's peaks checked after its function; ``since`` says
    from when the peak counts, ``note`` who checked."""
    if budget_host and host is not None and host > budget_host:
        raise MemoryBudgetExceeded(
            f"host memory budget exceeded: peak RSS {format_size(host, budget_host)}{since} > "
            f"budget {format_size(budget_host, host)}{note}"
        )
    if budget_device and device is not None and device > budget_device:
        raise MemoryBudgetExceeded(
            f"device memory budget exceeded: peak allocated {format_size(device, budget_device)}{since} > "
            f"budget {format_size(budget_device, device)}{note}"
        )


@dataclass(frozen=True)
class MemoryBudget:
    """Per-rank peak limits in bytes; ``None`` means unlimited on that side."""

    host_bytes: int | None = None
    device_bytes: int | None = None

    @classmethod
    def parse(cls, host: str | int | None = None, device: str | int | None = None) -> MemoryBudget:
        """Build from the marker's keyword values (sizes as strings or bytes)."""
        return cls(host_bytes=parse_size(host), device_bytes=parse_size(device))

    @classmethod
    def from_marker(cls, mark: object) -> MemoryBudget:
        """From a ``pytest.mark.memory_budget(host=..., device=...)`` mark; no positional args."""
        args = getattr(mark, "args", ())
        kwargs = dict(getattr(mark, "kwargs", {}))
        if args:
            raise ValueError(
                f"memory_budget takes keywords only, e.g. memory_budget(host='1.5GiB'), got positional {args!r}"
            )
        unknown = set(kwargs) - {"host", "device"}
        if unknown:
            raise ValueError(f"memory_budget got unknown keyword(s) {sorted(unknown)}: use host= and device=")
        return cls.parse(kwargs.get("host"), kwargs.get("device"))

    def describe(self) -> str:
        """``"host 1.50 GiB, device 4.00 GiB"`` for the report's budget column."""
        parts = []
        if self.host_bytes is not None:
            parts.append(f"host {format_size(self.host_bytes)}")
        if self.device_bytes is not None:
            parts.append(f"device {format_size(self.device_bytes)}")
        return ", ".join(parts) or "-"
