"""The session header's note on who created the pytest process' CUDA context.

No CUDA here: `initialized` is replaced by a switch (a stand-in for the context a GPU machine
creates, which this CPU runner cannot), so the edges the plugin and the launcher observe at can be
walked in the order a session reaches them.
"""

from __future__ import annotations

import pytest

from megatron_testkit import cuda_context
from megatron_testkit.cuda_context import KIT, OUTSIDE, TEST, Origin, header_note
from megatron_testkit.report import build_report, format_markdown

pytestmark = pytest.mark.L0


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """A switch standing for "this process holds a CUDA context", and no origin seen yet."""
    state = {"on": False}
    monkeypatch.setattr(cuda_context, "_origin", None)
    monkeypatch.setattr(cuda_context, "initialized", lambda: state["on"])
    return state


def test_no_context_and_a_tests_own_context_leave_the_header_silent() -> None:
    assert header_note(None) is None
    assert header_note(Origin(TEST, "t.py::uses_cuda")) is None


def test_a_context_the_kit_made_names_the_test_whose_results_held_cuda_tensors() -> None:
    note = header_note(Origin(KIT, "t.py::returns_cuda"))
    assert note is not None
    assert "t.py::returns_cuda" in note and "rank returned CUDA tensors" in note and ".cpu()" in note


def test_a_context_made_before_any_test_says_so() -> None:
    note = header_note(Origin(OUTSIDE))
    assert note is not None and "before any test ran" in note


def test_the_first_region_that_ends_with_a_context_is_its_origin(cuda: dict[str, bool]) -> None:
    # The order a session reaches the edges: before a test, before the kit reads results, after.
    cuda_context.observe(OUTSIDE)
    cuda_context.observe(TEST, "t.py::a")
    assert cuda_context.origin() is None  # no context yet: nothing recorded
    cuda["on"] = True  # reading a rank's CUDA tensor created it
    cuda_context.observe(KIT, "t.py::a")
    cuda_context.observe(TEST, "t.py::a")  # the test's end edge does not take it over
    cuda_context.observe(OUTSIDE)
    assert cuda_context.origin() == Origin(KIT, "t.py::a")


def test_a_context_the_test_made_before_reading_results_stays_the_tests(cuda: dict[str, bool]) -> None:
    cuda_context.observe(OUTSIDE)
    cuda["on"] = True  # the test's own code touched CUDA, then launched ranks
    cuda_context.observe(TEST, "t.py::b")  # the launcher's edge before it reads results
    cuda_context.observe(KIT, "t.py::b")
    assert header_note(cuda_context.origin()) is None


def test_a_context_before_the_first_test_is_outside_any_test(cuda: dict[str, bool]) -> None:
    cuda["on"] = True  # a conftest used CUDA at collection
    cuda_context.observe(OUTSIDE)
    cuda_context.observe(TEST, "t.py::c")
    assert cuda_context.origin() == Origin(OUTSIDE)


def test_no_cuda_context_on_this_cpu_runner() -> None:
    assert cuda_context.initialized() is False


def test_current_test_is_the_node_id_without_the_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "unit/t.py::x[a (b)] (call)")
    assert cuda_context.current_test() == "unit/t.py::x[a (b)]"
    monkeypatch.delenv("PYTEST_CURRENT_TEST")
    assert cuda_context.current_test() is None


def test_the_markdown_report_shows_the_note_under_its_header() -> None:
    note = header_note(Origin(KIT, "t.py::returns_cuda"))
    shown = format_markdown(build_report({"host": "h", "cuda_context": note}, []))
    assert f"CUDA context in pytest: {note}" in shown.replace("\\", "")
    assert "CUDA context" not in format_markdown(build_report({"host": "h"}, []))
