"""The markers a project's configuration file declares, as the exit-5 line names them: read from
each kind of file pytest takes its configuration from, the plugins' markers never among them."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_testkit.empty_selection import declared_markers

pytestmark = pytest.mark.L0


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("pytest.ini", "[pytest]\nmarkers =\n    slow: long\n    world(n): ranks\n"),
        ("tox.ini", "[tox]\n[pytest]\nmarkers =\n    slow: long\n    world(n): ranks\n"),
        ("setup.cfg", "[tool:pytest]\nmarkers =\n    slow: long\n    world(n): ranks\n"),
        ("pyproject.toml", '[tool.pytest.ini_options]\nmarkers = ["slow: long", "world(n): ranks"]\n'),
        ("pyproject.toml", '[tool.pytest]\nmarkers = ["slow: long", "world(n): ranks"]\n'),
    ],
)
def test_each_kind_of_configuration_file_names_its_markers(tmp_path: Path, name: str, text: str) -> None:
    (tmp_path / name).write_text(text)
    assert declared_markers(tmp_path / name) == ["slow", "world"]


def test_a_file_without_markers_declares_none_and_an_unreadable_one_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = -q\n")
    assert declared_markers(tmp_path / "pytest.ini") == []
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options\n")  # not TOML
    assert declared_markers(tmp_path / "pyproject.toml") is None
    assert declared_markers(tmp_path / "missing.ini") is None
    assert declared_markers(None) is None
