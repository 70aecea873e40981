"""Per-test ranks' settings: which tests it wraps, how many ranks each gets, what a rank's session
repeats of the command line; and a rank never hands fd 0 to its own files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_testkit import per_test

pytestmark = pytest.mark.L0
pytest_plugins = ["pytester"]


def test_the_ini_table_reads_glob_and_ranks_per_line_with_ids_that_hold_equals_signs() -> None:
    table = per_test.parse_table(["tests/a.py::* = 8", "tests/b.py::test_x[tp=2] = 4"])
    assert table == [("tests/a.py::*", 8), ("tests/b.py::test_x[tp=2]", 4)]


@pytest.mark.parametrize("line", ["tests/a.py::*", "= 8", "tests/a.py::* = 0", "tests/a.py::* = eight"])
def test_a_bad_table_line_is_a_usage_error_naming_it(line: str) -> None:
    with pytest.raises(pytest.UsageError, match=r"kit_ranks_per_test_ids: .* is not 'GLOB = N'"):
        per_test.parse_table([line])


def test_the_outer_command_lines_plugins_overrides_and_import_mode_are_repeated() -> None:
    args = ["-p", "fix", "-pother", "tests/x.py", "-o", "a=1", "--override-ini=b=2", "-x", "-k", "y",
            "--import-mode", "importlib", "-m", "L0"]  # fmt: skip
    assert per_test._forwarded(args) == [
        "-p", "fix", "-pother", "-o", "a=1", "--override-ini=b=2", "--import-mode", "importlib"
    ]  # fmt: skip


def _items(pytester: pytest.Pytester, source: str, ini: str = "") -> tuple[list, per_test.PerTestRanks]:
    pytester.makeini(f"[pytest]\nkit_ranks_per_test = 2\n{ini}")
    pytester.makepyfile(test_suite=source)
    items, _ = pytester.inline_genitems()
    mode = items[0].config.pluginmanager.get_plugin("kit-per-test")
    return items, mode


def test_which_tests_are_wrapped_and_on_how_many_ranks(pytester: pytest.Pytester) -> None:
    source = textwrap.dedent(
        """
        import pytest
        from megatron_testkit.ranks import run_ranks

        def body(rank, world_size):
            return rank

        def test_plain():
            pass

        @pytest.mark.ranks_per_test(8)
        def test_marked():
            pass

        def test_in_the_table():
            pass

        @pytest.mark.world_size(2)
        def test_launches_its_own():
            pass

        def test_calls_run_ranks():
            run_ranks(body, 2)
        """
    )
    items, mode = _items(pytester, source, "kit_ranks_per_test_ids =\n    *in_the_table = 4\n")
    by_name = {item.name: item for item in items}
    assert mode is not None
    wrapped = {name: mode.wraps(item) for name, item in by_name.items()}
    assert wrapped == {
        "test_plain": True,
        "test_marked": True,
        "test_in_the_table": True,
        "test_launches_its_own": False,  # world_size(n) keeps its meaning: it calls run_ranks
        "test_calls_run_ranks": False,
    }
    ranks = {
        name: mode.ranks_for(by_name[name]) for name in ("test_plain", "test_marked", "test_in_the_table")
    }
    assert ranks == {"test_plain": 2, "test_marked": 8, "test_in_the_table": 4}


def test_the_mode_is_off_inside_a_rank_and_a_bad_setting_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(per_test.NODE_ENV, "t.py::test_x")
    _, mode = _items(pytester, "def test_x():\n    pass\n")
    assert mode is None
    monkeypatch.delenv(per_test.NODE_ENV)
    pytester.makeini("[pytest]\nkit_ranks_per_test = two\n")
    result = pytester.runpytest_inprocess()
    assert "kit_ranks_per_test in the pytest ini = 'two': expected a number of ranks (0: off)" in str(
        result.stderr
    )


def test_a_rank_started_with_stdin_closed_keeps_its_state_file_off_fd_0(tmp_path: Path) -> None:
    # A rank forked with fd 0 closed opened its state file as fd 0; pytest's capture in a per-test
    # rank then pointed fd 0 at /dev/null and every later state line was lost.
    code = textwrap.dedent(
        f"""
        import os
        from megatron_testkit.rank_worker import _open_standard_fds
        os.close(0)
        _open_standard_fds()
        fd = os.open({str(tmp_path / "state")!r}, os.O_WRONLY | os.O_CREAT)
        print(fd, os.readlink("/proc/self/fd/0"))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    fd, stdin = out.split()
    assert int(fd) > 2 and stdin == "/dev/null"


def test_a_per_test_ranks_failure_shows_the_tests_traceback_not_the_kits_frames() -> None:
    from megatron_testkit.diagnosis import without_kit_frames

    text = (
        "Traceback (most recent call last):\n"
        '  File "/x/megatron_testkit/per_test_rank.py", line 70, in run_node\n'
        '    raise RankTestFailure("\\n\\n".join(outcome.failures))\n'
        "megatron_testkit.per_test_rank.RankTestFailure: RuntimeError: boom\n"
        "  def test_x():\n"
        ">       Utils.initialize_model_parallel(2, 4)\n"
    )
    shown = without_kit_frames(text)
    assert "per_test_rank.py" not in shown and "raise RankTestFailure" not in shown
    assert ">       Utils.initialize_model_parallel(2, 4)" in shown
