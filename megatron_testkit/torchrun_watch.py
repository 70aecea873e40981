"""Under torchrun: the stall rule and the end-of-call gather, through the job's store.

No launcher watches a torchrun job's ranks, so each rank watches its peers itself. For each
`run_ranks` call every rank publishes, under a key prefix of the call's own in the job's store
(torchrun's TCPStore, or any ``torch.distributed.Store``):

- its wait state every `POLL_S`: what each thread waits on (group, #k, peer: the same tracking
  as a spawned rank's, `megatron_testkit.waits`), its counts, its CPU seconds without the kit's
  threads, and its phase (``fn`` while it runs the function, ``gather`` once it is done);
- its outcome at the end of the call (returned, or failed with its record).

A thread of each rank (`CallWatch`) reads its peers' states into a `StallDetector`, a rank in
``gather`` counting as exited from the function, and applies the deadlock rule of the spawning
launcher (`megatron_testkit.wait_graph`); the first rank to reach a verdict posts it, once, for
all. `gather` waits for every rank's outcome, bounded: it ends on the posted verdict, or names the
ranks that did not arrive within the call's timeout.

A rank blocked in a collective cannot be given back to its pytest session: a gloo call that a
peer never joins returns only when that peer's process exits (``abort``, ``shutdown`` and
``destroy_process_group`` on either side leave it blocked). So a rank the verdict finds blocked
posts its main thread's stack, writes its report with the verdict as its test's failure, and
exits (`megatron_testkit.last_words`); its exit ends the job (the agent stops the other ranks,
whose sessions end with their reports). The ranks that were waiting in the gather fail the test
with the same verdict first.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from megatron_testkit import procfs, stall, wait_graph
from megatron_testkit.waits import WaitTracker

__all__ = ["POLL_S", "CallWatch", "tracker"]

POLL_S = 0.25  # how often a rank publishes its state and reads its peers'
# How long the ranks the verdict found blocked wait for the others to read it (and them for the
# blocked ranks' stacks) before they exit: the readers poll every `POLL_S`.
HANDOVER_S = 5.0
STACK_FRAMES = 8  # of a blocked rank's main thread, innermost, in the verdict


class _Tracker:
    """This process' collectives, as a spawned rank tracks them (`rank_worker._Rank`), without its
    state file: each thread's wait, the counts, the collective the main thread is inside."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waits = WaitTracker()
        self.seq = 0
        self.group_seq = 0
        self.depth = 0
        self.inside: str | None = None
        self.last: str | None = None
        self.kit_tids: list[int] = []

    def install(self) -> None:
        from megatron_testkit.collectives import CollectiveCounter

        CollectiveCounter(on_call=self.called, record=False).install()
        stall.track_work_waits(self.waiting, self.waited)

    def _count(self, name: str) -> None:
        if name != "wait":
            self.seq += 1
            self.group_seq += name not in stall.P2P_OPS
            self.last = f"{name} #{self.seq}"
        if self.depth == 0:
            self.inside = self.last if name != "wait" else f"wait on {self.last or 'an op'}"
        self.depth += 1

    def _uncount(self) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.inside = None

    def called(self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self.lock:
            self._count(name)
            frame = self.waits.enter(name, original, args, kwargs)

        def done(result: Any) -> None:
            with self.lock:
                self.waits.leave(frame, result)
                self._uncount()

        return done

    def waiting(self, work: Any) -> Any:
        with self.lock:
            self._count("wait")
            return self.waits.enter_wait(work)

    def waited(self, frame: Any) -> None:
        with self.lock:
            self.waits.leave(frame)
            self._uncount()

    def main_blocked(self) -> bool:
        """The main thread is inside a collective."""
        with self.lock:
            return bool(self.waits.frames.get(threading.main_thread().ident or -1))

    def state(self) -> dict[str, Any]:
        """The fields of a spawned rank's state line (`stall.read_position` reads the same)."""
        with self.lock:
            self.waits.refresh()  # every group of this rank, so a member that never called one counts 0
            return {
                "last_collective": self.last,
                "seq": self.seq,
                "group_seq": self.group_seq,
                "inside": self.inside,
                "ready": True,
                **self.waits.state(),
                "groups": dict(self.waits.groups),
            }


_TRACKER: _Tracker | None = None
_TRACKER_LOCK = threading.Lock()


def tracker() -> _Tracker:
    """This process' collective tracking, installed at the first call (it lives as long as the process)."""
    global _TRACKER
    with _TRACKER_LOCK:
        if _TRACKER is None:
            _TRACKER = _Tracker()
            _TRACKER.install()
        return _TRACKER


def _position(state: dict[str, Any]) -> stall.Position:
    work = state.get("work")
    return stall.Position(
        inside=state.get("inside") if isinstance(state.get("inside"), str) else None,
        seq=state["seq"] if isinstance(state.get("seq"), int) else 0,
        group_seq=state["group_seq"] if isinstance(state.get("group_seq"), int) else 0,
        ready=True,
        work=float(work) if isinstance(work, (int, float)) and not isinstance(work, bool) else None,
        waits=wait_graph.parse_waits(state),
    )


class CallWatch:
    """One `run_ranks` call's watch on this rank: publishes, reads, judges (module docstring)."""

    def __init__(
        self,
        store: Any,
        prefix: str,
        rank: int,
        world_size: int,
        window: float | None,
        on_blocked: Callable[[CallWatch, dict[str, Any], dict[int, str]], None],
    ) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.world_size = rank, world_size
        self.tracker = tracker()
        self.detector = stall.StallDetector(window) if window is not None else None
        self.on_blocked = on_blocked
        self.phase = "fn"
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kit-torchrun-watch", daemon=True)
        self._cpu_tid: int | None = None
        self._store_lock = threading.Lock()  # one request at a time on the store's client

    # -- the store -------------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def set(self, name: str, value: bytes | str) -> None:
        with self._store_lock:
            self.store.set(self._key(name), value)

    def get(self, name: str) -> bytes | None:
        """The value, None while the key does not exist (never blocks)."""
        with self._store_lock:
            if not self.store.check([self._key(name)]):
                return None
            return self.store.get(self._key(name))

    def verdict(self) -> dict[str, Any] | None:
        raw = self.get("verdict")
        return json.loads(raw) if raw else None

    # -- this rank -------------------------------------------------------------------------------
    def start(self) -> CallWatch:
        self.publish()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=2 * POLL_S + 1)

    def arrive(self, outcome: tuple[str, Any]) -> None:
        """This rank is done with the function: its outcome, and its phase, for the peers."""
        self.phase = "gather"
        self.set(f"outcome/{self.rank}", pickle.dumps(outcome))
        self.publish()

    def publish(self) -> None:
        state = self.tracker.state()
        state["phase"] = self.phase
        state["work"] = self._own_cpu()
        self.set(f"state/{self.rank}", json.dumps(state, separators=(",", ":")))

    def _own_cpu(self) -> float | None:
        """This process' CPU seconds without the kit's watch threads (theirs is not the rank's progress)."""
        total = procfs.cpu_seconds(os.getpid())
        if total is None:
            return None
        if self._cpu_tid is not None:
            total -= procfs.cpu_seconds(os.getpid(), self._cpu_tid) or 0.0
        return total

    # -- the peers -------------------------------------------------------------------------------
    def _run(self) -> None:
        self._cpu_tid = threading.get_native_id()
        acted = False
        while not self.stopped.wait(POLL_S):
            try:
                self.publish()
                verdict = self.verdict()
                if verdict is None and self.detector is not None:
                    verdict = self._judge()
                if verdict is not None and not acted and self.phase == "fn" and self.tracker.main_blocked():
                    acted = True
                    self._hand_over(verdict)
            except Exception as exc:  # the store went away (the job is ending): the gather's bound remains
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"kit: torchrun stall watch of rank {self.rank} stopped: {exc}\n")
                return

    def _judge(self) -> dict[str, Any] | None:
        """Read every rank's state into the detector; post a verdict when it gives one."""
        assert self.detector is not None
        now = time.monotonic()
        live = []
        for r in range(self.world_size):
            raw = self.get(f"state/{r}")
            state = json.loads(raw) if raw else None
            if not isinstance(state, dict):
                live.append(r)  # not published yet: no verdict without its position
                continue
            if state.get("phase") == "gather":
                if r not in self.detector.exited:
                    self.detector.observe(now, r, _position(state))
                    self.detector.rank_exited(r)
                continue
            live.append(r)
            self.detector.observe(now, r, _position(state))
        found = self.detector.verdict(now, live)
        if found is None:
            return None
        blocked = sorted(r for r in live if self.detector.stalled(now, r))
        posted = {
            "rank": found.rank,
            "why": found.why,
            "lines": list(found.lines),
            "waits": list(found.waits),
            "cycle": list(found.cycle),
            "blocked": blocked,
            "exited": sorted(self.detector.exited),
            "by": self.rank,
        }
        with self._store_lock:  # the first verdict stands: every rank names the same one
            raw = self.store.compare_set(self._key("verdict"), "", json.dumps(posted))
        return json.loads(raw)

    def _hand_over(self, verdict: dict[str, Any]) -> None:
        """This rank is blocked in a collective the verdict names: its stack for the peers, then
        (once they read the verdict, or `HANDOVER_S`) its report and its end (`on_blocked`)."""
        frame = sys._current_frames().get(threading.main_thread().ident or -1)
        # The innermost frames: the test's function down to the collective (pytest's own above them).
        stack = "".join(traceback.format_stack(frame)[-STACK_FRAMES:]) if frame is not None else ""
        self.set(f"stack/{self.rank}", stack)
        waiting = [r for r in range(self.world_size) if r not in verdict.get("blocked", [])]
        deadline = time.monotonic() + HANDOVER_S
        while time.monotonic() < deadline:
            with self._store_lock:
                seen = self.store.add(self._key("verdict_seen"), 0)
            if seen >= len(waiting):
                break
            time.sleep(POLL_S / 5)
        stacks = {self.rank: stack}
        self.on_blocked(self, verdict, stacks)

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The blocked ranks' stacks as they posted them (waits up to `HANDOVER_S` for them)."""
        out: dict[int, str] = {}
        deadline = time.monotonic() + HANDOVER_S
        while True:
            for r in ranks:
                if r not in out and (raw := self.get(f"stack/{r}")) is not None:
                    out[r] = raw.decode(errors="replace")
            if len(out) == len(ranks) or time.monotonic() > deadline:
                return out
            time.sleep(POLL_S / 5)

    def seen(self) -> None:
        """This rank read the verdict (the blocked ranks wait for every reader before they exit)."""
        with self._store_lock:
            self.store.add(self._key("verdict_seen"), 1)
