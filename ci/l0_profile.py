"""A pytest plugin for `python -m ci l0-bench --against`: the child processes each test started, and how long.

Loaded only by that command, as a module of its own (``-p kit_l0_profile``, copied beside the
reports), so that the previous main's tree, which lacks it, loads the same one. Every process of
the session (the controller, each xdist worker) appends one JSON line per child process it waited
for, and per in-process nested session (`pytester`'s inline runs), to
``$CI_L0_PROFILE_DIR/<pid>.jsonl``: the running test, the kind, the command's first words and the
start and end (monotonic seconds). It imports nothing of the kit: the tree under test is what runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

# Not a KIT_ variable: the kit records those as settings of the run, and this is the bench's own.
DIR_ENV = "CI_L0_PROFILE_DIR"
# Processes the kit's report already accounts for (its ranks and its warm parent): not recorded.
KIT_TAGS = ("kit-rank-", "kit-warm-parent")
# An xdist worker, as execnet starts it: the session itself, not a child of any test.
XDIST_WORKER = "exec(eval(sys.stdin.readline()))"
CLI_MODULES = ("accounting", "ci", "megatron_testkit")

_state: dict[str, Any] = {"nodeid": None, "path": None}


def classify(argv: Sequence[str]) -> str | None:
    """``nested`` (a pytest session, or ci/test.sh which runs one), ``cli`` (one of this
    repository's commands), ``other``; None for the kit's own ranks and warm parent, and for the
    session's own xdist workers."""
    words = [str(word) for word in argv]
    if any(word.startswith(KIT_TAGS) or XDIST_WORKER in word for word in words):
        return None
    names = [os.path.basename(word) for word in words]
    if "-mpytest" in words or "pytest" in names[:1] or "py.test" in names[:1] or "test.sh" in names:
        return "nested"
    for i, word in enumerate(words[:-1]):
        if word == "-m":
            module = words[i + 1]
            if module == "pytest":
                return "nested"
            if module.split(".")[0] in CLI_MODULES:
                return "cli"
    if words[:1] and os.path.basename(words[0]) in ("megatron-testkit", "megatron-accounting"):
        return "cli"
    return "other"


def _write(record: dict[str, Any]) -> None:
    path = _state["path"]
    if path is None:
        return
    with open(path, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _words(args: Any) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        return [os.fsdecode(args)]
    return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


_popen_init = subprocess.Popen.__init__
_popen_wait = subprocess.Popen.wait
_popen_poll = subprocess.Popen.poll


def _init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
    words = _words(args)
    record = {
        "nodeid": _state["nodeid"],
        "kind": classify(words),
        "argv": words[:6],
        "start": time.monotonic(),
    }
    self._kit_l0 = record  # type: ignore[attr-defined]
    _popen_init(self, args, *rest, **kwargs)


def _done(self: subprocess.Popen) -> None:
    record = getattr(self, "_kit_l0", None)
    if record is not None and self.returncode is not None:
        self._kit_l0 = None  # type: ignore[attr-defined]
        if record["kind"] is not None:
            _write({**record, "end": time.monotonic()})


def _wait(self: subprocess.Popen, *args: Any, **kwargs: Any) -> Any:
    try:
        return _popen_wait(self, *args, **kwargs)
    finally:
        _done(self)


def _poll(self: subprocess.Popen) -> Any:
    code = _popen_poll(self)
    _done(self)
    return code


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get(DIR_ENV)
    if not folder or _state["path"] is not None:
        return
    os.makedirs(folder, exist_ok=True)
    _state["path"] = os.path.join(folder, f"{os.getpid()}.jsonl")
    subprocess.Popen.__init__ = _init  # type: ignore[method-assign]
    subprocess.Popen.wait = _wait  # type: ignore[method-assign]
    subprocess.Popen.poll = _poll  # type: ignore[method-assign]
    from _pytest.pytester import Pytester

    inline = Pytester.inline_run

    def inline_run(self: Pytester, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return inline(self, *args, **kwargs)
        finally:
            _write({"nodeid": _state["nodeid"], "kind": "nested", "argv": ["pytester.inline_run"],
                    "start": start, "end": time.monotonic()})  # fmt: skip

    Pytester.inline_run = inline_run  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    outer = _state["nodeid"]
    _state["nodeid"] = item.nodeid
    try:
        return (yield)
    finally:
        _state["nodeid"] = outer
