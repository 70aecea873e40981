"""`python -m megatron_testkit`'s own help texts and the summary's one-line repro, as a user calls them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_testkit.cli import main

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent
# Every command and subcommand with a --help, named here (not read from cli.py, which this checks).
HELPS = (
    (),
    ("repro",),
    ("golden",),
    ("golden", "update"),
    ("golden", "diff"),
    ("chart",),
    ("merge-reports",),
    ("summary",),
)
_HEADINGS = ("usage:", "options:", "positional arguments:", "commands:")


def _prose(text: str) -> list[str]:
    """The help's paragraphs of prose: not the usage block, nor a heading's indented entries."""
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    return [
        " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
        if not p.startswith(_HEADINGS) and not p.startswith(" ")
    ]


@pytest.mark.parametrize("words", HELPS, ids=lambda w: " ".join(w) or "top")
def test_every_help_text_is_whole_on_stdout(
    words: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main([*words, "--help"])
    except SystemExit as exit_:  # argparse's own --help exits
        code = exit_.code
    out, err = capsys.readouterr()
    assert code in (0, None) and err == "", err
    assert out.startswith("usage: python -m megatron_testkit"), out
    for paragraph in _prose(out):
        # A sentence cut where a docstring's first line ended reads "... or (--annotations) the".
        assert paragraph.endswith((".", ".'")), f"{' '.join(words)}: cut short: {paragraph!r}"


def _summary(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "megatron_testkit", "summary", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def test_the_repro_line_is_exactly_one_line_the_command(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GITHUB_")}
    (tmp_path / "kit-report.md").write_text("## Kit report\n\n| test | outcome |\n")
    # In a GitHub job: the run's artifact is downloaded first.
    job = _summary(
        str(tmp_path),
        "--artifact",
        "kit-reports-unit",
        "--repro-line",
        env={**base, "GITHUB_RUN_ID": "42", "GITHUB_REPOSITORY": "me/proj"},
    )
    assert job.returncode == 0, job.stderr
    assert job.stdout == (
        "gh run download 42 --repo me/proj --name kit-reports-unit --dir kit-reports-unit && "
        "python -m megatron_testkit repro --from-report kit-reports-unit/kit-report.json\n"
    )
    # Elsewhere, with an artifact: its report, downloaded into a folder of its name.
    named = _summary(str(tmp_path), "--artifact", "kit-reports-unit", "--repro-line", env=base)
    assert named.stdout == "python -m megatron_testkit repro --from-report kit-reports-unit/kit-report.json\n"
    # A local run: the report folder as given, with the caller's own repro command (the line ran
    # nowhere when it named a bare kit-report.json beside the project's root).
    local = _summary(str(tmp_path), "--repro-line", "--repro-command", "tox -e repro --", env=base)
    assert (
        local.returncode == 0
        and local.stdout == f"tox -e repro -- --from-report {tmp_path}/kit-report.json\n"
    )
    # Negative control: without the flag the same call prints the whole summary.
    whole = _summary(str(tmp_path), env=base)
    assert whole.stdout.count("\n") > 1 and "## Kit report" in whole.stdout
