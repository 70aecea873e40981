"""The rows a repro can emulate: a project's CI jobs as data, from its pyproject or from a report.

A row is what one CI job runs: its pytest selection and arguments, its environment, its memory
limits and GPUs. A project declares its rows in ``[tool.megatron_testkit.rows.<name>]`` of its
``pyproject.toml`` (read with `tomllib`, `tomli` on Python 3.10); with none, the session a report
recorded is the row (`session_row`: its mark expression, the settings `repro_settings.restorable`
lets through, its runner memory and GPUs). This repository's own rows come from ``ci/jobs.py``,
turned into `Row`s by ``ci/repro.py``. A value ``{reports}`` in a row's environment is the report
folder of the run.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, printable, read_regular_file
from megatron_testkit.budgets import parse_size
from megatron_testkit.repro_settings import restorable
from megatron_testkit.schema import MAX_GPUS

TIERS = ("L0", "L1", "L2")
PYPROJECT = "pyproject.toml"
MAX_PYPROJECT_BYTES = 4 * 2**20
# A mark expression read from a report: pytest parses it, but it must read as one.
MAX_MARKEXPR_CHARS = 1000
_ROW_KEYS = (
    "tier",
    "markexpr",
    "pytest-args",
    "env",
    "host-memory",
    "device-memory",
    "gpus",
    "megatron-core",
    "runs-on",
)


class RowError(ValueError):
    """A row that cannot be used (a bad pyproject entry, a report's session that is not a row)."""


@dataclass(frozen=True)
class Row:
    """One CI job as a repro emulates it.

    The pytest command is ``pytest *selection --kit-report=R --junitxml=R/junit.xml *pytest_args``.
    `runs_tests` False: the row runs something else (a benchmark row), `not_tests` says what.
    `setup_hint`: how to get the row's megatron-core release, when this Python has another.
    """

    name: str
    tier: str | None
    selection: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    host_memory: str | None = None
    device_memory: str | None = None
    gpus: int = 0
    megatron_core: str | None = None
    runs_on: tuple[str, ...] = ()
    source: str = ""
    runs_tests: bool = True
    not_tests: str = ""
    setup_hint: str | None = None

    def environment(self, reports: Path) -> dict[str, str]:
        """The row's variables, ``{reports}`` replaced by the report folder."""
        return {key: str(value).replace("{reports}", str(reports)) for key, value in self.env.items()}

    def describe(self) -> str:
        """``"job L0-cpu (tier L0, runs-on ubuntu-latest)"``, naming where the row comes from when
        it is not a declared row."""
        parts = [f"tier {self.tier or '-'}"]
        if self.runs_on:
            parts.append(f"runs-on {', '.join(self.runs_on)}")
        if self.source:
            parts.append(self.source)
        label = f"job {printable(self.name, 80)}" if self.name else "the session"
        return f"{label} ({', '.join(parts)})"


def tier_of(markexpr: str) -> str | None:
    """The tier a mark expression selects first (``"L0 and gpu"`` -> ``"L0"``), if any."""
    first = markexpr.split(" ")[0]
    return first if first in TIERS else None


def default_row(tier: str, gpus: int) -> Row:
    """What a project without rows runs for ``repro L0``: the tier, nothing else."""
    return Row(name=tier, tier=tier, selection=("-m", tier), gpus=gpus, source="no row declared")


def choose(
    rows: Mapping[str, Row], tier: str | None, gpus: int | None, megatron_core: str | None = None
) -> Row | None:
    """The first row (in declaration order) of `tier` that runs tests on GPUs iff `gpus`, on
    `megatron_core` when it is given and a row names one; None when no row fits."""
    for row in rows.values():
        if not row.runs_tests or row.tier != (tier or "L0"):
            continue
        if (row.gpus > 0) != bool(gpus):
            continue
        if megatron_core is not None and row.megatron_core not in (None, megatron_core):
            continue
        return row
    return None


def session_row(session: Mapping[str, Any], name: str | None = None) -> Row:
    """The row a report's session is: its mark expression, the settings a repro may restore, its
    runner memory (KIT_HOST_MEMORY or the cgroup's limit) and device memory, its GPUs."""
    markexpr = str(session.get("markexpr") or "")
    if markexpr and (
        markexpr.startswith("-") or not markexpr.isprintable() or len(markexpr) > MAX_MARKEXPR_CHARS
    ):
        raise RowError(f"the report's session.markexpr {printable(markexpr, 80)!r} is not a mark expression")
    restored = restorable(session.get("settings") or [])
    env = dict(restored.applied)
    host = session.get("runner_memory_bytes")
    gpus = session.get("gpus")
    core = session.get("megatron_core")
    return Row(
        name=name or str(session.get("ci_job") or ""),
        tier=tier_of(markexpr),
        selection=("-m", markexpr) if markexpr else (),
        env=env,
        host_memory=f"{host}B" if isinstance(host, int) and host > 0 else None,
        device_memory=env.get("KIT_DEVICE_MEMORY"),
        gpus=gpus if isinstance(gpus, int) and 0 <= gpus <= MAX_GPUS else 0,
        megatron_core=core if isinstance(core, str) and core.isprintable() and len(core) < 40 else None,
        source="the report's recorded session",
    )


def _toml() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    import tomli  # a dependency of the kit on Python 3.10

    return tomli


def pyproject_rows(root: Path) -> dict[str, Row]:
    """The rows of ``[tool.megatron_testkit.rows]`` in `root`'s pyproject.toml ({} when it declares
    none); `RowError` in one line naming the row and the key otherwise."""
    path = root / PYPROJECT
    if not path.is_file():
        return {}
    try:
        text = read_regular_file(path, MAX_PYPROJECT_BYTES, PYPROJECT).decode("utf-8")
        data = _toml().loads(text)
    except (JsonInputError, UnicodeDecodeError, ValueError) as exc:  # TOMLDecodeError is a ValueError
        raise RowError(f"{path}: {exc}") from None
    table = data.get("tool", {}).get("megatron_testkit", {})
    if not isinstance(table, dict):
        raise RowError(f"{path}: [tool.megatron_testkit] is not a table")
    unknown = sorted(set(table) - {"rows"})
    if unknown:
        raise RowError(f"{path}: [tool.megatron_testkit] has unknown key {unknown[0]!r} (expected rows)")
    rows = table.get("rows", {})
    if not isinstance(rows, dict):
        raise RowError(f"{path}: [tool.megatron_testkit.rows] is not a table")
    return {str(name): _row(str(name), spec, path) for name, spec in rows.items()}


def _row(name: str, spec: Any, path: Path) -> Row:
    where = f"{path}: [tool.megatron_testkit.rows.{name}]"
    if not isinstance(spec, dict):
        raise RowError(f"{where} is not a table")
    unknown = sorted(set(spec) - set(_ROW_KEYS))
    if unknown:
        raise RowError(f"{where}: unknown key {unknown[0]!r} (expected one of {', '.join(_ROW_KEYS)})")

    def text(key: str) -> str | None:
        value = spec.get(key)
        if value is not None and not isinstance(value, str):
            raise RowError(f"{where}: {key} is not a string")
        return value

    def words(key: str) -> tuple[str, ...]:
        value = spec.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise RowError(f"{where}: {key} is not a list of strings")
        return tuple(value)

    markexpr = text("markexpr") or ""
    tier = text("tier") or tier_of(markexpr)
    if tier is not None and tier not in TIERS:
        raise RowError(f"{where}: tier {tier!r} is not one of {', '.join(TIERS)}")
    env = spec.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, (str, int)) for v in env.values()):
        raise RowError(f"{where}: env is not a table of strings")
    for key in ("host-memory", "device-memory"):
        try:
            parse_size(text(key))
        except ValueError as exc:
            raise RowError(f"{where}: {key}: {exc}") from None
    gpus = spec.get("gpus", 0)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or not 0 <= gpus <= MAX_GPUS:
        raise RowError(f"{where}: gpus is not a whole number from 0 to {MAX_GPUS}")
    return Row(
        name=name,
        tier=tier,
        selection=("-m", markexpr) if markexpr else (("-m", tier) if tier else ()),
        pytest_args=words("pytest-args"),
        env={str(k): str(v) for k, v in env.items()},
        host_memory=text("host-memory"),
        device_memory=text("device-memory"),
        gpus=gpus,
        megatron_core=text("megatron-core"),
        runs_on=words("runs-on"),
    )
