"""``ci/setup.sh`` with ``KIT_SYSTEM_PYTHON=1`` installs under the image's pip constraints.

NGC's containers pin every preinstalled package in a constraint file; a pin older than what the kit
needs used to stop the job in pip's resolver before a test ran. setup.sh now passes the file to
every pip call and refuses a conflicting pin in one line before pip runs. The constraint files here
are made up in NGC's form; the interpreter is this one behind a wrapper that stands in for pip
(records its arguments and exits), because a real install would need the network and would change
this environment.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent
PIP_STANDS_IN = 97  # the wrapper's exit code when setup.sh called pip


def _interpreter(tmp_path: Path) -> tuple[Path, Path]:
    """An interpreter that is this one, except that ``-m pip`` records its arguments and exits."""
    calls = tmp_path / "pip-calls"
    wrapper = tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -m ] && [ "$2" = pip ]; then\n'
        f'  printf "%s\\n" "$*" >>{calls}\n'
        f"  exit {PIP_STANDS_IN}\n"
        "fi\n"
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, calls


def _setup(tmp_path: Path, constraint: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    wrapper, calls = _interpreter(tmp_path)
    env = {**os.environ, "KIT_SYSTEM_PYTHON": "1", "PYTHON": str(wrapper), "PIP_CONSTRAINT": constraint}
    env.pop("KIT_MEGATRON_CORE", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "setup.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    return proc, calls


def test_a_pin_older_than_the_kit_needs_is_one_line_before_pip_runs(tmp_path: Path) -> None:
    constraints = tmp_path / "constraint.txt"
    constraints.write_text(
        "# NGC's form: every preinstalled package pinned\n"
        "hypothesis==6.90.0\n"
        "torch==2.8.0a0+5228986c39.nv25.6\n"
        "numpy==1.26.4\n"
        "nvidia-dali-cuda120 @ file:///opt/dali.whl\n"
    )
    proc, calls = _setup(tmp_path, str(constraints))
    assert proc.returncode == 1, proc.stderr
    assert not calls.exists(), f"pip ran: {calls.read_text()}"
    assert proc.stdout == ""
    conflicts = [line for line in proc.stderr.splitlines() if "pip constraint" in line]
    assert conflicts == [
        f"ci/setup.sh: the image's pip constraint hypothesis==6.90.0 ({constraints}) conflicts with "
        f"what the kit needs: hypothesis>=6.100"
    ]


def test_megatron_cores_packaging_need_is_checked_too(tmp_path: Path) -> None:
    constraints = tmp_path / "constraint.txt"
    constraints.write_text("packaging==23.2\n")
    proc, calls = _setup(tmp_path, str(constraints))
    assert proc.returncode == 1 and not calls.exists(), proc.stderr
    assert "pip constraint packaging==23.2" in proc.stderr and "needs: packaging>=24.2" in proc.stderr


def test_pins_that_fit_reach_every_pip_call(tmp_path: Path) -> None:
    constraints = tmp_path / "constraint.txt"
    constraints.write_text("hypothesis==6.140.0\npytest-xdist==3.8.0\npackaging==25.0\nnumpy==1.26.4\n")
    proc, calls = _setup(tmp_path, str(constraints))
    # Past the check, setup.sh called pip (the wrapper) with the constraint file.
    assert proc.returncode == PIP_STANDS_IN, proc.stderr
    assert "pip constraint" not in proc.stderr
    first = calls.read_text().splitlines()[0]
    assert " install " in f" {first} " and first.endswith(f"-c {constraints}")


def test_a_constraint_file_that_does_not_exist_is_a_usage_error(tmp_path: Path) -> None:
    proc, calls = _setup(tmp_path, str(tmp_path / "missing.txt"))
    assert proc.returncode == 2 and not calls.exists()
    assert proc.stderr.strip().splitlines() == [
        f"ci/setup.sh: the pip constraint file {tmp_path / 'missing.txt'} (PIP_CONSTRAINT) does not exist"
    ]
