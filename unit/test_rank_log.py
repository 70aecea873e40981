"""`megatron_testkit.rank_log`: a rank's log keeps its head and its tail within the cap, and says what was cut.

A real child process writes into the pipe as a rank does (its stdout is the pipe's write end); the
expected file is built from what the child was told to write, not from the code under test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_testkit.rank_log import CAP_ENV, DEFAULT_CAP, MIN_CAP, CappedLog, log_cap

pytestmark = pytest.mark.L0

# The child writes `n` numbered lines of 100 bytes each: every byte says where it was.
WRITER = "import sys\nfor i in range(int(sys.argv[1])):\n    sys.stdout.write(f'{i:099d}\\n')\n"


def _run(tmp_path: Path, lines: int, cap: int) -> tuple[bytes, CappedLog, str]:
    log = CappedLog(open(tmp_path / "rank0.log", "wb"), cap, rank=0)  # noqa: SIM115 (closed by log.close)
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(lines)], stdout=log.write_fd)
    log.started()
    assert proc.wait(timeout=120) == 0
    tail = log.tail_text(1000)
    log.close()
    return (tmp_path / "rank0.log").read_bytes(), log, tail


def _output(lines: int) -> bytes:
    return b"".join(f"{i:099d}\n".encode() for i in range(lines))


def test_output_under_the_cap_is_the_log_unchanged(tmp_path: Path) -> None:
    data, log, tail = _run(tmp_path, 500, 2**20)  # 50 kB
    assert data == _output(500) and log.cut == 0
    assert tail == _output(500)[-1000:].decode()


def test_output_past_the_cap_keeps_the_head_and_the_tail_and_says_how_much_was_cut(tmp_path: Path) -> None:
    cap = MIN_CAP  # 64 KiB: 32 KiB of head, 32 KiB of tail
    data, log, tail = _run(tmp_path, 20_000, cap)  # 2 MB written
    out = _output(20_000)
    head, rest = data[: cap // 2], data[cap // 2 :]
    assert head == out[: cap // 2]
    assert rest.endswith(out[-(cap // 2) :])
    cut = len(out) - cap
    line = f"\n[kit: {cut} bytes of rank 0's output cut here: the first {cap // 2} and the last {cap // 2} bytes are kept ({CAP_ENV}={cap})]\n"
    assert rest == line.encode() + out[-(cap // 2) :]
    assert log.cut == cut
    assert tail == out[-1000:].decode()  # the diagnosis reads the newest output


def test_the_cap_setting_is_a_size_with_a_floor() -> None:
    assert log_cap({}) == DEFAULT_CAP
    assert log_cap({CAP_ENV: "1MiB"}) == 2**20
    for bad in ("lots", "1KiB", "-5", "nan"):
        with pytest.raises(ValueError, match=f"^{CAP_ENV}="):
            log_cap({CAP_ENV: bad})
