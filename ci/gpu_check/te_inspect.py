"""Step ``te_inspect``: the tensor inspector through TE + nvdlfw-inspect on one GPU, its statistics checked.

Runs the functional test's 1-rank TE variant (`functional/test_tensor_inspect.py`,
``[te-nvdlfw-1rank]``: TE's modules, nvdlfw-inspect's session, every statistic compared with the
test's own fp32 capture within the derived bf16 tolerance), with its kit report in
OUTDIR/te_inspect/. Not as a CI run (no ``CI=true``): a missing golden file for this GPU's
platform writes a candidate next to where the file belongs, and the step lists it with the
command that makes the files from the report. No skip is allowed (TE and nvdlfw-inspect must
import). The dry run runs the same test's 1-rank CPU variant for real (hooks, fp32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ci.gpu_check.pytest_step import ROOT, junit_counts, pytest_argv, run_pytest
from ci.gpu_check.summary import expect
from ci.jobs import ALLOWED_SKIPS_ENV

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

TEST = "functional/test_tensor_inspect.py::test_slim_tensor_inspect_records_exact_stats_on_steps_5_and_10"
GPU_VARIANT = "te-nvdlfw-1rank"
CPU_VARIANT = "default-precision-1rank"


def step(check: CheckState) -> dict[str, Any]:
    """The variant must pass and have run (not skipped); its golden candidates are listed."""
    from megatron_testkit.golden_candidates import UPDATE_COMMAND, missing_golden_files

    report = check.out / "te_inspect"
    nodeid = f"{TEST}[{CPU_VARIANT if check.dry else GPU_VARIANT}]"
    cmd = pytest_argv([nodeid], report)
    env = {
        "KIT_REQUIRE_GPUS": "0" if check.dry else "1",
        ALLOWED_SKIPS_ENV: "",
        "CI": "",
        "PYTHONUNBUFFERED": "1",
    }
    figures = run_pytest(
        cmd, env, check.out / "te_inspect.log", timeout=min(400, max(10.0, check.remaining() - 5))
    )
    figures.update(junit_counts(report / "junit.xml"))
    expect(figures["returncode"] == 0, f"{nodeid} exited {figures['returncode']}: {figures['last_line']}")
    expect(figures.get("ran") == 1, f"{nodeid} did not run: {figures}")
    candidates = missing_golden_files(report, ROOT)
    figures["golden_candidates"] = [str(c.path) for c in candidates]
    if candidates:
        figures["make_golden_files"] = f"{UPDATE_COMMAND} {report / 'kit-report.json'}"
    return figures
