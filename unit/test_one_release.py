"""``python -m ci one-release``: an overlay's ``megatron`` holds one megatron-core release only.

ci/setup.sh's overlay venv (one release over the base venv's site directory) merged the base's
``megatron/training`` into the overlay's namespace ``megatron``: 0.19.2's training over 0.16.1's
core. Two site folders laid out as the overlay and the base venv are (a release's ``megatron/``
and its ``dist-info``), searched by a plain interpreter without its own site-packages.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent


def _release(site: Path, version: str, packages: tuple[str, ...]) -> None:
    """A megatron-core release installed in ``site`` the way a wheel lays it out."""
    for name in packages:
        (site / "megatron" / name).mkdir(parents=True)
        (site / "megatron" / name / "__init__.py").write_text(f"RELEASE = {version!r}\n")
    info = site / f"megatron_core-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: megatron-core\nVersion: {version}\n")


def _check(overlay: Path, base: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(overlay), str(base)])}
    return subprocess.run(
        [sys.executable, "-S", "-m", "ci", "one-release"], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def sites(tmp_path: Path) -> tuple[Path, Path]:
    overlay, base = tmp_path / "overlay", tmp_path / "base"
    _release(overlay, "0.16.1", ("core",))  # 0.16.1's wheel ships megatron/core only
    _release(base, "0.19.2", ("core", "training"))
    return overlay, base


def test_a_namespace_megatron_that_reaches_into_the_base_venv_is_named(sites: tuple[Path, Path]) -> None:
    overlay, base = sites
    done = _check(overlay, base)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"megatron.training comes from {base.resolve() / 'megatron' / 'training'}" in done.stderr
    assert "megatron-core 0.16.1" in done.stderr


def test_the_overlays_regular_megatron_package_holds_its_own_release_only(sites: tuple[Path, Path]) -> None:
    overlay, base = sites
    (overlay / "megatron" / "__init__.py").write_text("")  # what ci/setup.sh writes in the overlay
    done = _check(overlay, base)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == f"megatron-core 0.16.1: every part of `megatron` is in {overlay.resolve()}"
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import megatron.training"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(overlay), str(base)])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "No module named 'megatron.training'" in probe.stderr


def test_setup_sh_makes_the_overlay_megatron_a_regular_package_and_checks_it() -> None:
    setup = (ROOT / "ci" / "setup.sh").read_text()
    assert ': >"$site/megatron/__init__.py"' in setup
    assert '"$py" -m ci one-release' in setup
