"""`megatron_testkit.safe_write`: every file the kit writes stays in its folder, never goes through a
link, and is whole or absent, whatever the disk does.

The full disk is real: the file-size limit (RLIMIT_FSIZE) makes the kernel refuse a write past it
(EFBIG) exactly where a full disk refuses one (ENOSPC), in a child process so this one keeps its
limits. A read-only folder is real too: as root (which ignores permission bits) the child drops
to the `nobody` user.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from megatron_testkit.report import build_report, write_report

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("relative", ["../x.json", "/etc/x.json", "a/../../x.json", "a//b.json", "", "a/./b"])
def test_a_path_that_would_leave_the_folder_is_refused_before_anything_is_opened(
    relative: str, tmp_path: Path
) -> None:
    from megatron_testkit.safe_write import Folder, WriteRefused

    folder = Folder(tmp_path / "golden")
    with pytest.raises(WriteRefused) as err:
        folder.write_text(relative, "{}")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden"]
    assert list((tmp_path / "golden").iterdir()) == []


def test_a_link_inside_the_folder_dangling_or_not_is_refused_with_its_name(tmp_path: Path) -> None:
    from megatron_testkit.safe_write import Folder, WriteRefused

    folder = Folder(tmp_path / "golden")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.json").write_text('{"series": {}}')
    (tmp_path / "golden" / "dangling.json").symlink_to(tmp_path / "created-by-the-link.json")
    (tmp_path / "golden" / "existing.json").symlink_to(outside / "x.json")
    (tmp_path / "golden" / "linked_dir").symlink_to(outside)
    for relative in ("dangling.json", "existing.json", "linked_dir/x.json", "linked_dir/new.json"):
        with pytest.raises(WriteRefused, match="is a link: the kit never writes through one") as err:
            folder.write_text(relative, '{"pwned": true}')
        assert relative.split("/")[0] in str(err.value)
    assert not (tmp_path / "created-by-the-link.json").exists()
    assert (outside / "x.json").read_text() == '{"series": {}}'
    assert sorted(p.name for p in outside.iterdir()) == ["x.json"]


def test_links_above_the_folder_are_the_users_own_and_work(tmp_path: Path) -> None:
    from megatron_testkit.safe_write import Folder

    real = tmp_path / "real-home"
    (real / "project").mkdir(parents=True)
    (tmp_path / "home").symlink_to(real)  # a checkout under a linked home, macOS's /var
    folder = Folder(tmp_path / "home" / "project" / "golden")
    written = folder.write_text("test_x/t.cpu-gloo.json", "{}\n")
    assert written == real / "project" / "golden" / "test_x" / "t.cpu-gloo.json"
    assert written.read_text() == "{}\n"
    assert [p.name for p in written.parent.iterdir()] == ["t.cpu-gloo.json"]  # no temporary file left


def test_a_fifo_or_a_folder_where_a_file_belongs_is_refused(tmp_path: Path) -> None:
    from megatron_testkit.safe_write import Folder, WriteRefused

    folder = Folder(tmp_path)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "dir.json").mkdir()
    for name in ("fifo.json", "dir.json"):
        with pytest.raises(WriteRefused, match="exists and is not a regular file"):
            folder.write_text(name, "{}")


def test_a_folder_that_is_a_file_is_a_one_line_refusal(tmp_path: Path) -> None:
    from megatron_testkit.safe_write import Folder, WriteRefused, check_relative

    (tmp_path / "reports").write_text("not a folder")
    with pytest.raises(WriteRefused) as err:
        Folder(tmp_path / "reports", what="--kit-report folder")
    assert str(err.value).startswith("--kit-report folder ") and "\n" not in str(err.value)
    assert check_relative("a/b.json") == ("a", "b.json")


FULL_DISK = textwrap.dedent(
    """
    import json, resource, signal, sys
    from megatron_testkit.report import build_report, write_report
    from megatron_testkit.safe_write import WriteRefused

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, as ENOSPC would
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    report = json.loads(open(sys.argv[2]).read())
    try:
        write_report(report, sys.argv[1])
    except WriteRefused as exc:
        print(exc)
        sys.exit(3)
    """
)


def _report(rows: int, marker: str) -> dict:
    tests = [{"nodeid": f"t.py::{marker}{i}", "outcome": "passed"} for i in range(rows)]
    return build_report({"started": marker, "host": "h"}, tests)


def test_a_full_disk_leaves_the_previous_report_whole_and_says_so_in_one_line(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    write_report(_report(2, "before"), reports)
    before = (reports / "kit-report.json").read_bytes()
    big = tmp_path / "big.json"
    big.write_text(json.dumps(_report(200, "after")))  # ~20 kB of JSON: past the 4 kB limit
    result = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(reports), str(big)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert result.stdout.count("\n") == 1 and "cannot write" in result.stdout, result.stdout
    assert "the previous file, if any, is unchanged" in result.stdout
    assert (reports / "kit-report.json").read_bytes() == before  # whole, not cut at 4 KiB
    json.loads(before)
    assert not [p for p in reports.iterdir() if p.name.endswith(".tmp")]


READ_ONLY = textwrap.dedent(
    """
    import os, sys
    from megatron_testkit.report_dir import SessionLogs
    from megatron_testkit.safe_write import WriteRefused

    if os.getuid() == 0:
        os.setgid(65534)
        os.setuid(65534)  # root ignores permission bits: be nobody, whom they stop
    try:
        SessionLogs(__import__("pathlib").Path(sys.argv[1]))
    except WriteRefused as exc:
        print(exc)
        sys.exit(3)
    """
)


def test_a_read_only_report_folder_is_a_one_line_refusal() -> None:
    base = Path(tempfile.mkdtemp(prefix="kit-read-only-"))  # under /tmp: `nobody` can reach it
    base.chmod(0o755)
    reports = base / "reports"
    reports.mkdir()
    reports.chmod(0o555)
    try:
        result = subprocess.run(
            [sys.executable, "-c", READ_ONLY, str(reports)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        reports.chmod(0o755)
        shutil.rmtree(base)
    assert result.returncode == 3, result.stderr
    assert result.stdout.count("\n") == 1 and "Permission denied" in result.stdout, result.stdout
    assert "cannot make the folder" in result.stdout and str(reports / "logs") in result.stdout
