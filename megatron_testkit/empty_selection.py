"""The one line that explains a session that selected no test (pytest's exit 5).

A project without this repository's tier markers that runs ``-m L0`` deselects every test and
goes red with no hint; this line names the selection and the markers the project declares."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

_INI_SECTIONS = {"setup.cfg": "tool:pytest"}  # every other ini file: [pytest]
_MAX_CONFIG_BYTES = 1 << 20  # a configuration file larger than this is not read


def _names(lines: list[str]) -> list[str]:
    """Marker names from ``markers`` lines (``slow: long tests``, ``world_size(n): ...``), once each."""
    names: list[str] = []
    for line in lines:
        name = line.split(":", 1)[0].split("(", 1)[0].strip()
        if name and name not in names:
            names.append(name)
    return names


def _toml_markers(text: str) -> list[str]:
    from megatron_testkit.repro_rows import _toml  # tomllib, or tomli on Python 3.10

    tool = _toml().loads(text).get("tool", {}).get("pytest", {})
    table = tool.get("ini_options", tool) if isinstance(tool, dict) else {}
    markers = table.get("markers", []) if isinstance(table, dict) else []
    return _names([m for m in markers if isinstance(m, str)]) if isinstance(markers, list) else []


def _ini_markers(path: Path, text: str) -> list[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read_string(text)
    section = _INI_SECTIONS.get(path.name, "pytest")
    if not parser.has_option(section, "markers"):
        return []
    return _names(parser.get(section, "markers").splitlines())


def declared_markers(inipath: Path | None) -> list[str] | None:
    """The marker names the project's configuration file declares (its ``markers`` key), None
    when there is no file or it cannot be read. Read from the file: pytest's own list also holds
    every plugin's markers, with nothing to tell them apart."""
    if inipath is None:
        return None
    try:
        if inipath.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        text = inipath.read_text(encoding="utf-8")
        return _toml_markers(text) if inipath.suffix == ".toml" else _ini_markers(inipath, text)
    except (OSError, UnicodeError, ValueError, configparser.Error):  # TOMLDecodeError is a ValueError
        return None


def explain(config: pytest.Config) -> str:
    """``kit: no test selected (pytest exit 5) by -m 'L0'; this project declares the markers: a, b``."""
    parts = []
    markexpr = config.getoption("markexpr", "") or ""
    keyword = config.getoption("keyword", "") or ""
    if markexpr:
        parts.append(f"-m {markexpr!r}")
    if keyword:
        parts.append(f"-k {keyword!r}")
    paths = [str(a) for a in config.invocation_params.args if not str(a).startswith("-")]
    selection = " ".join(parts) if parts else "no -m or -k expression"
    where = f" in {' '.join(paths)}" if paths and not parts else ""
    declared = declared_markers(config.inipath)
    if declared:
        markers = f"this project declares the markers: {', '.join(declared)}"
    elif declared is None:
        markers = "no pytest configuration file of this project declares markers"
    else:
        markers = f"{config.inipath.name if config.inipath else 'its configuration'} declares no markers"
    return f"kit: no test selected (pytest exit 5) by {selection}{where}; {markers}"
