"""`megatron_testkit.library_helpers`: which processes are a library's, kept for the rank's life.

The declared entries are parsed strictly, the rank's notes are read as untrusted lines, and a
process counts as a library's only when that library's code started it (run in a fresh
interpreter: `track` patches ``multiprocessing`` for the life of the process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_testkit import library_helpers

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("entry", ["megatron.core", "module:", "path:/x", "command:  "])
def test_a_malformed_entry_is_refused_naming_it(entry: str) -> None:
    with pytest.raises(ValueError, match="kit_library_helpers entry"):
        library_helpers.parse([entry])


def test_entries_parse_by_kind_and_the_default_names_megatrons_checkpointing() -> None:
    assert library_helpers.parse(["module: a.b ", "", "# note", "command:x y"]) == (
        ("module", "a.b"),
        ("command", "x y"),
    )
    assert library_helpers.parse(library_helpers.DEFAULT) == (("module", "megatron.core.dist_checkpointing"),)


def test_a_ranks_notes_are_read_as_untrusted_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"pid": 4242, "by": "lib.writer (SpawnProcess SyncManager-1)"}),
        "not json",
        json.dumps({"pid": True, "by": "x"}),  # a bool is no pid
        json.dumps({"pid": 1, "by": "init"}),  # never init
        json.dumps(["pid", 5]),
        json.dumps({"pid": 77, "by": "y" * 1000}),
    ]
    (tmp_path / "rank1.helpers").write_text("\n".join(lines) + "\n")
    found = library_helpers.read_helpers(tmp_path, 2)
    assert set(found) == {4242, 77}
    assert found[4242] == "rank 1: lib.writer (SpawnProcess SyncManager-1)"
    assert len(found[77]) == len("rank 1: ") + 300


def test_only_a_process_the_declared_librarys_code_starts_is_noted(tmp_path: Path) -> None:
    (tmp_path / "fakelib").mkdir()
    (tmp_path / "fakelib" / "__init__.py").write_text("")
    (tmp_path / "fakelib" / "writer.py").write_text(
        textwrap.dedent(
            """
            import multiprocessing

            WORKER = None

            def start():
                global WORKER
                WORKER = multiprocessing.get_context("fork").Process(target=int, name="lib-worker")
                WORKER.start()
                return WORKER
            """
        )
    )
    script = textwrap.dedent(
        f"""
        import json, multiprocessing, sys
        from pathlib import Path
        from megatron_testkit import library_helpers

        library_helpers.track((("module", "fakelib"),), Path({str(tmp_path / "rank0.helpers")!r}))
        import fakelib.writer
        theirs = fakelib.writer.start()
        mine = multiprocessing.get_context("fork").Process(target=int, name="test-worker")
        mine.start()
        for p in (theirs, mine):
            p.join()
        print(json.dumps({{"theirs": theirs.pid, "mine": mine.pid, "noted": list(library_helpers.started())}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["noted"] == [result["theirs"]]
    assert library_helpers.read_helpers(tmp_path, 1) == {
        result["theirs"]: "rank 0: fakelib.writer (ForkProcess lib-worker)"
    }


def test_a_helpers_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    import threading

    os.mkfifo(tmp_path / "rank0.helpers")  # no writer: a plain open() would wait for one for ever
    (tmp_path / "rank1.helpers").write_text(
        json.dumps({"pid": 4242, "by": "megatron.core (Process x)"}) + "\n"
    )
    found: list[dict[int, str]] = []
    reader = threading.Thread(
        target=lambda: found.append(library_helpers.read_helpers(tmp_path, 2)), daemon=True
    )
    reader.start()
    reader.join(30)  # far above a read of two small files; only a blocked open() reaches it
    assert found == [{4242: "rank 1: megatron.core (Process x)"}]
