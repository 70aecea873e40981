"""Two top-level pytest sessions on one machine share its memory (`megatron_testkit.machine_ledger`).

Each session has a 1.25 GiB runner of its own (KIT_HOST_MEMORY) and runs two one-rank tests of a
600 MiB budget, one at a time; the machine is 700 MiB (KIT_MACHINE_MEMORY), so only one of the four
launches fits at once. Each rank stamps its start, holds until a rank of the other session has
stamped too (or 3 s), and records its span: sessions that each admitted their own runner overlap
at once; sharing the machine's ledger, no two spans overlap. A nested session beside them keeps its
private ledger, and no rank sees the machine's.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, inner_env

SESSION = textwrap.dedent(
    """
    import json, os, time
    from pathlib import Path

    import pytest

    from megatron_testkit.ranks import run_ranks


    def hold(rank, world_size, stamps, me):
        start = time.time()
        Path(stamps, f"{me}.{os.getpid()}").touch()
        end = time.monotonic() + 3
        while time.monotonic() < end and not any(not n.startswith(me) for n in os.listdir(stamps)):
            time.sleep(0.05)
        time.sleep(0.3)
        return [start, time.time(), "KIT_MACHINE_LEDGER" in os.environ]


    @pytest.mark.memory_budget(host="600MiB")
    @pytest.mark.parametrize("i", range(2))
    def test_hold(i):
        me = os.environ["ME"]
        out = run_ranks(hold, 1, args=(os.environ["STAMPS"], me), timeout=120)[0]
        with open(os.environ["SPANS"], "a") as f:
            f.write(json.dumps([me, *out, os.environ.get("KIT_MACHINE_LEDGER")]) + "\\n")
    """
)


def _start(root: Path, me: str, machine: Path, stamps: Path, spans: Path) -> subprocess.Popen:
    env = inner_env()
    for name in ("KIT_ADMISSION_DIR", "KIT_OUTER_SESSION", "KIT_MACHINE_LEDGER", "KIT_MACHINE_ADMISSION"):
        env.pop(name, None)  # a session a developer starts in a terminal of its own
    env.update(
        {
            "KIT_HOST_MEMORY": "1280MiB",
            "KIT_MACHINE_MEMORY": "700MiB",
            "KIT_MACHINE_ADMISSION_DIR": str(machine),
            "ME": me,
            "STAMPS": str(stamps),
            "SPANS": str(spans),
        }
    )
    folder = root / me
    folder.mkdir()
    (folder / "test_hold.py").write_text(SESSION)
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "-p", "no:randomly", "test_hold.py"],
        cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


@pytest.mark.L1
def test_two_top_level_sessions_never_admit_the_machine_twice(tmp_path: Path) -> None:
    machine, stamps, spans = tmp_path / "machine", tmp_path / "stamps", tmp_path / "spans.jsonl"
    stamps.mkdir()
    sessions = [_start(tmp_path, me, machine, stamps, spans) for me in ("a", "b")]
    outputs = [proc.communicate(timeout=600)[0] for proc in sessions]
    for proc, output in zip(sessions, outputs, strict=True):
        assert proc.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in spans.read_text().splitlines()]
    assert sorted(r[0] for r in rows) == ["a", "a", "b", "b"]
    # Both sessions' launches went through the one machine ledger; no rank saw it.
    assert {r[4] for r in rows} == {str(machine)} and not any(r[3] for r in rows)
    spans_by_start = sorted((r[1], r[2]) for r in rows)
    for (_, end), (start, _) in itertools.pairwise(spans_by_start):
        assert end <= start, f"two launches ran at once on a 700 MiB machine: {spans_by_start}"


NESTED = textwrap.dedent(
    """
    import os


    def test_env():
        with open(os.environ["OUT"], "w") as f:
            f.write(repr(os.environ.get("KIT_MACHINE_LEDGER")))
    """
)


@pytest.mark.L0
def test_a_session_inside_a_test_keeps_its_private_ledger(tmp_path: Path) -> None:
    (tmp_path / "test_env.py").write_text(NESTED)
    env = inner_env()
    env.pop("KIT_ADMISSION_DIR", None)  # a ledger of its own, as functional/test_admission.py's sessions
    env.update({"OUT": str(tmp_path / "out"), "KIT_MACHINE_ADMISSION_DIR": str(tmp_path / "machine")})
    assert os.environ["KIT_OUTER_SESSION"]  # this test runs below a kit session: the inner one is nested
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "test_env.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert (tmp_path / "out").read_text() == "None"
    assert not (tmp_path / "machine").exists()
