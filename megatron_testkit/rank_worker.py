"""The inside of one rank: set up, run the test's function, leave a record, exit.

Started by `megatron_testkit.ranks` as ``python -c <bootstrap>`` in its own session, with stdout and
stderr going to the rank's log file. Whatever happens it leaves ``rank<N>.json`` (the record the
parent diagnoses) unless the process is killed outright; the parent then reads the exit signal.
Faulthandler writes Python stacks to ``rank<N>.stacks`` on a fatal signal and on SIGUSR1, which the
parent sends before it kills a hung or surviving rank.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import faulthandler
import json
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from megatron_testkit import devices, library_helpers, procfs, rank_record, rank_result, stall
from megatron_testkit.budgets import check_peaks
from megatron_testkit.procfs import current_rss_bytes
from megatron_testkit.waits import WaitTracker

# Exit code of a rank stopped by its host memory budget (its record says so).
BUDGET_EXIT = 86
# Exit code of a rank whose launcher died before the rank could ask to die with it.
ORPHAN_EXIT = 87
# The launching process' pid, which the rank checks is still its parent (set by the launcher).
LAUNCHER_ENV = "KIT_LAUNCHER_PID"
# The signal number whose Python handler parks the main thread once the host budget is crossed
# (a real-time signal nothing else uses; None where the platform has none). The watchdog never
# sends it: `_thread.interrupt_main` runs the handler in the main thread at its next bytecode.
PARK_SIGNAL: int | None = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of this process' resident set (VmHWM), exact, in bytes."""
    peak = procfs.peak_rss_bytes()
    if peak is not None:
        return peak
    import resource  # no /proc: the best the platform offers

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_device_bytes() -> int | None:
    """Peak CUDA memory allocated by this process, or None when CUDA was never initialised."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.max_memory_allocated())
    except Exception:  # torch half-imported: the watchdog can fire while `import torch` runs
        return None


def _cpu_substitutions() -> dict[str, int]:
    """What the CPU layer substituted in this rank (`megatron_testkit.megatron_cpu`), if it was used."""
    shim = sys.modules.get("megatron_testkit.megatron_cpu")
    return shim.substitutions() if shim is not None else {}


def _device_and_platform(backend: str) -> dict[str, str | None]:
    """This rank's own device and the golden platform it names (read by the launcher into its `Run`)."""
    from megatron_testkit.platforms import launch_platform

    device = devices.rank_device_name()
    return {"device": device, "platform": launch_platform(backend, device)}


class _Rank:
    """State of this rank: its files, last collective and memory watchdog."""

    def __init__(self, spec: dict[str, Any], rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.run_dir = Path(spec["run_dir"])
        self.started = time.time()
        self.lock = threading.Lock()
        self.collective_seq = 0
        self.group_seq = 0  # the group collectives among them (point-to-point ops excluded)
        self.last_collective: str | None = None
        # The collective this rank is inside (the outermost: one collective may call another), for
        # the launcher's stall detection (`megatron_testkit.stall`); None outside any.
        self.inside: str | None = None
        self.depth = 0
        self.ready = False  # its process group is up
        self.ready_at: float | None = None  # when (time.time()), for the report's setup_s
        self.kit_tids: list[int] = []  # the kit's own threads, whose CPU is not the rank's progress
        self.waits = WaitTracker()  # each thread's collective: group, sequence number, peer
        self.state_size = stall.STATE_LINE_BYTES
        self.state_fd = os.open(self.run_dir / f"rank{rank}.state", os.O_WRONLY | os.O_CREAT, 0o644)
        self.stacks = open(self.run_dir / f"rank{rank}.stacks", "w")  # noqa: SIM115 (lives until exit)
        self.record_written = False
        self.stopping = False  # a budget watchdog tripped and is ending the rank
        # Before the test's function starts, memory is the rank's startup footprint (Python,
        # torch, the test's module, the process group): a budget crossed then is too small.
        self.in_function = False
        self.idle_host_bytes: int | None = None
        self.memory = TreeMemory()
        self.budget_host: int | None = None
        self.budget_device: int | None = None

    # -- records -----------------------------------------------------------------------------
    def write_record(self, status: str, **fields: Any) -> None:
        """Write rank<N>.json atomically (once), so the parent never reads half a record.

        ``fields`` are the failure's (`rank_record.WrittenRecord`'s exception fields)."""
        with self.lock:
            if self.record_written:
                return
            rank_record.write(
                self.run_dir,
                rank_record.WrittenRecord(
                    rank=self.rank,
                    pid=os.getpid(),
                    status=status,
                    started=self.started,
                    time=time.time(),
                    peak_host_bytes=max(peak_rss_bytes(), self.memory.peak),
                    peak_process=self.memory.describe_holder(),
                    peak_device_bytes=peak_device_bytes(),
                    **_device_and_platform(self.spec["backend"]),
                    last_collective=self.last_collective,
                    collective_seq=self.collective_seq,
                    in_function=self.in_function,
                    idle_host_bytes=self.idle_host_bytes,
                    ready_at=self.ready_at,
                    cpu_substitutions=_cpu_substitutions(),
                    **fields,
                ),
            )
            self.record_written = True  # only once it exists: a failed attempt leaves room for the next

    def fail(self, exc: BaseException, kind_hint: str | None = None, message: str | None = None) -> None:
        """Record an exception with its traceback, echo it to the log, and exit at once.

        No destroy_process_group: with collectives still queued it can deadlock (PyTorch's test
        harness skips it after errors for the same reason). Exiting closes the sockets, so the
        peers fail fast instead of waiting for a timeout.
        """
        tb_obj = exc.__traceback__
        # Start the traceback at the test's function: the launcher's own frame is noise.
        if tb_obj is not None and tb_obj.tb_frame.f_code.co_filename == __file__ and tb_obj.tb_next:
            tb_obj = tb_obj.tb_next
        tb = "".join(traceback.format_exception(type(exc), exc, tb_obj))
        # The record first: the echo can fail (a function that closed or redirected stderr), and
        # the exception must not be lost with it.
        self.write_record(
            "failed",
            exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
            exc_message=message or str(exc),
            traceback=tb,
            kind_hint=kind_hint,
        )
        _echo(tb)
        _flush_and_exit(1)

    # -- collectives -------------------------------------------------------------------------
    def entered(self, name: str) -> None:
        """Note the collective just entered (in the record and in rank<N>.state for crashes and stalls)."""
        with self.lock:
            self._count(name)
            self.write_state()

    def _count(self, name: str) -> None:
        if name != "wait":  # waiting on an async op is time inside it, not a new collective
            self.collective_seq += 1
            self.group_seq += name not in stall.P2P_OPS
            self.last_collective = f"{name} #{self.collective_seq}"
        if self.depth == 0:
            self.inside = (
                self.last_collective if name != "wait" else f"wait on {self.last_collective or 'an op'}"
            )
        self.depth += 1

    def left(self, name: str) -> None:
        """Note that the call entered last returned (or raised)."""
        with self.lock:
            self._uncount()
            self.write_state()

    def _uncount(self) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth == 0:
            self.inside = None

    def called(self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A collective entered with its arguments: counted, and its group and sequence noted
        for this thread (`megatron_testkit.waits`); returns what to call with its result."""
        with self.lock:
            self._count(name)
            frame = self.waits.enter(name, original, args, kwargs)
            self.write_state()

        def done(result: Any) -> None:
            with self.lock:
                self.waits.leave(frame, result)
                self._uncount()
                self.write_state()

        return done

    def waiting(self, work: Any) -> Any:
        """``Work.wait()`` began: time inside the collective that made ``work``."""
        with self.lock:
            self._count("wait")
            frame = self.waits.enter_wait(work)
            if self.waits.depth() == 1:  # not inside a collective already (``barrier`` waits on its own op)
                self.write_state()
        return frame

    def waited(self, frame: Any) -> None:
        with self.lock:
            self.waits.leave(frame)
            self._uncount()
            if self.waits.depth() == 0:
                self.write_state()

    def write_state(self) -> None:
        """rank<N>.state: the last collective, the one the rank is inside, each thread's wait
        (group, sequence number, peer), whether it is set up."""
        self.state_size = stall.write_state(
            self.state_fd,
            {
                "last_collective": self.last_collective,
                "seq": self.collective_seq,
                "group_seq": self.group_seq,
                "inside": self.inside,
                "ready": self.ready,
                "ready_at": self.ready_at,
                "kit_tids": self.kit_tids,
                **self.waits.state(),
            },
            self.state_size,
            self.waits.groups_json(),
        )

    def track_collectives(self) -> None:
        """Wrap torch.distributed's collectives to remember the last one entered and each thread's wait.

        Both ``torch.distributed`` and ``distributed_c10d`` are patched before the test module is
        imported, so ``from torch.distributed import all_reduce`` in it sees the wrapper too. The
        counter keeps no call list (it lives as long as the rank) and is never uninstalled.
        """
        from megatron_testkit.collectives import CollectiveCounter

        CollectiveCounter(on_call=self.called, record=False).install()
        stall.track_work_waits(self.waiting, self.waited)

    # -- memory ------------------------------------------------------------------------------
    def watch_host_memory(self, budget: int, interval: float = 0.02) -> None:
        """Stop the rank as `oom` when its memory (with its descendants') crosses the host budget.

        A sampled RSS watchdog rather than a resource limit: RLIMIT_AS counts virtual
        reservations (CUDA and allocator arenas reserve far more than they touch) and RLIMIT_DATA
        counts private writable mappings, which include untouched thread stacks and malloc arenas;
        both would fail ranks for memory they never used, and neither measures what the budget
        states (resident memory). The rank's worker processes (DataLoader workers, pools) count
        too: the runner's kernel charges them to the same job. The watchdog can miss a spike
        shorter than its interval; the exact high-water mark (VmHWM) is checked again after the
        function returns.

        Two threads. Every file read of a /proc sample releases the GIL, and a function that
        allocates back to back takes it for a whole allocation each time: a rank whose one
        thread read /proc was first seen over a 512 MiB budget at 1.2-1.5 GiB. So the rank's
        own RSS is checked alone, every ``interval``, with a read that keeps the GIL
        (`OwnResidentSet`); the sum with the descendants is sampled by the second thread.
        """
        _install_park_handler()
        own = OwnResidentSet()

        def watch_own() -> None:
            with self.lock:
                self.kit_tids.append(threading.get_native_id())
            while True:
                rss = own.read()
                if rss > budget:
                    self.stop_for_budget(rss, [], budget)
                time.sleep(interval)

        def watch_tree() -> None:
            with self.lock:
                self.kit_tids.append(threading.get_native_id())
            while True:
                rss, parts = self.memory.sample()
                if rss > budget:
                    self.stop_for_budget(rss, parts, budget)
                time.sleep(interval)

        threading.Thread(target=watch_own, name="kit-rss-watchdog", daemon=True).start()
        threading.Thread(target=watch_tree, name="kit-tree-watchdog", daemon=True).start()

    def stop_for_budget(self, rss: int, parts: list[tuple[int, int]], budget: int) -> None:
        """Record the budget overrun (stacks, who held the memory), then exit with `BUDGET_EXIT`.

        The main thread is parked first: each time this thread released the GIL while it wrote
        the record, the test's function went on allocating, and a rank stopped at 538 MiB of a
        512 MiB budget had reached 1.1-1.9 GiB by its exit (the very runner death the budget is
        there to prevent). Parked, it finishes at most the allocation it is in.
        """
        with self.lock:  # both watchdogs can trip: the first one records and exits
            if self.stopping:
                return
            self.stopping = True
        faulthandler.dump_traceback(file=self.stacks, all_threads=True)  # C, keeps the GIL
        _park_main_thread()
        with contextlib.suppress(OSError, ValueError):
            self.stacks.flush()
        message = f"host memory budget exceeded: RSS {_fmt(rss, budget)} > budget {_fmt(budget, rss)} (stopped by the kit's RSS watchdog)"
        if parts:
            message += f"; {_held_by(rss, parts)}"
        if not self.in_function:
            message += " before the test's function started (the rank's startup footprint)"
        self.write_record(
            "failed",
            exc_type="megatron_testkit.MemoryBudgetExceeded",
            exc_message=message,
            traceback=_main_thread_stack(),
            kind_hint="oom",
            budget_exceeded="host",
        )
        _echo(f"rank {self.rank}: {message}\n")
        _flush_and_exit(BUDGET_EXIT)


class OwnResidentSet:
    """This process' resident set now (/proc/self/statm), read without releasing the GIL.

    `pread` through ``ctypes.PyDLL`` keeps the GIL, so a function busy allocating cannot run
    between the watchdog's wake-up and its verdict. Not `getrusage`: its ``ru_maxrss`` carries
    the peak of the process image before ``exec`` (the forking pytest's), hundreds of MiB that
    were never this rank's. Where /proc or libc is missing, the plain (GIL-releasing) read.
    """

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._buffer = ctypes.create_string_buffer(128)
        try:
            self._fd: int | None = os.open("/proc/self/statm", os.O_RDONLY)
            pread = ctypes.PyDLL(None, use_errno=True).pread
            pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
            pread.restype = ctypes.c_ssize_t
            self._pread: Any = pread
        except (OSError, AttributeError):
            self._fd, self._pread = None, None

    def read(self) -> int:
        """Resident bytes now."""
        if self._fd is not None:
            got = self._pread(self._fd, self._buffer, len(self._buffer) - 1, 0)
            fields = self._buffer.raw[: max(got, 0)].split()
            if len(fields) > 1:
                return int(fields[1]) * self._page
        return current_rss_bytes()


class TreeMemory:
    """This process' resident memory plus its descendants', and the peak of that sum.

    The descendants are listed again every ``refresh`` samples (a /proc walk over every thread);
    their sizes are read at each sample, as the rank's own.
    """

    def __init__(self, refresh: int = 5) -> None:
        self.refresh = refresh
        self.peak = 0
        self.holder: tuple[int, int] | None = None  # (pid, bytes): the largest descendant at the peak
        self._children: list[int] = []
        self._samples = 0

    def sample(self) -> tuple[int, list[tuple[int, int]]]:
        """The sum now, and ``(pid, bytes)`` of each descendant holding memory."""
        if self._samples % self.refresh == 0:
            self._children = procfs.descendant_pids()
        self._samples += 1
        parts = [(pid, size) for pid in self._children if (size := procfs.unique_bytes(pid))]
        total = current_rss_bytes() + sum(size for _, size in parts)
        if total > self.peak:
            self.peak = total
            self.holder = max(parts, key=lambda part: part[1]) if parts else None
        return total, parts

    def describe_holder(self) -> str | None:
        """Which descendant held the most at the peak, e.g. ``pid 12: python -c ... held 800MiB``."""
        if self.holder is None:
            return None
        pid, size = self.holder
        return f"{procfs.command_line(pid)} held {_fmt(size)} of the rank's peak {_fmt(self.peak)}"


def _held_by(total: int, parts: list[tuple[int, int]]) -> str:
    """``the rank's own RSS 300MiB, its descendants 800MiB (largest pid 12: ...)``."""
    children = sum(size for _, size in parts)
    pid, size = max(parts, key=lambda part: part[1])
    return (
        f"the rank's own RSS {_fmt(total - children)}, its {len(parts)} descendant process(es) "
        f"{_fmt(children)} (largest {procfs.command_line(pid)}: {_fmt(size)})"
    )


def _park(signum: int, frame: Any) -> None:
    """Hold the main thread here (the GIL released) until the budget watchdog ends the rank."""
    while True:
        time.sleep(3600)


def _install_park_handler() -> None:
    """Register `_park` for `PARK_SIGNAL` (from the main thread, where Python allows it)."""
    if PARK_SIGNAL is not None and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            signal.signal(PARK_SIGNAL, _park)


def _park_main_thread() -> None:
    """Stop the test's function at its next bytecode, unless it took the signal for itself."""
    if PARK_SIGNAL is not None and signal.getsignal(PARK_SIGNAL) is _park:
        with contextlib.suppress(Exception):
            _thread.interrupt_main(PARK_SIGNAL)


def _main_thread_stack() -> str:
    """The main thread's stack, as the test's function left it (without the parking frames)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    walk = frame
    while walk is not None:
        if walk.f_code is _park.__code__:
            frame = walk.f_back
            break
        walk = walk.f_back
    return "".join(traceback.format_stack(frame)) if frame is not None else ""


def _fmt(size: int, other: int | None = None) -> str:
    """``size`` for a message; exact bytes too where it would read the same as ``other`` beside it."""
    from megatron_testkit.budgets import format_size

    return format_size(size, other)


def _echo(text: str) -> None:
    """Write to the rank's log; a stream the test's function closed or broke is not an error here."""
    with contextlib.suppress(Exception):
        sys.stderr.write(text)


def _flush_and_exit(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    # os._exit: atexit handlers (multiprocessing Managers, NCCL teardown) can hang a failing rank.
    os._exit(code)


def _adopt_orphans() -> None:
    """Become a child subreaper (Linux): an orphan anywhere below this rank (a daemon that
    double-forked, left its session and cleared its environment) re-parents to the rank, so its
    memory counts in the rank's budget and the launcher finds it. Without it (other platforms)
    the launcher's other nets remain."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _die_with_parent(launcher: int | None) -> None:
    """Ask the kernel to SIGKILL this rank if the launching process dies (Linux only).

    The request covers only a death after it is made: a launcher that died between spawning
    this rank and now has already re-parented it, so the parent is checked once more after it,
    and a rank whose launcher is gone exits before running anything.
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if launcher is not None and os.getppid() != launcher:
        os._exit(ORPHAN_EXIT)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    import torch

    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)


def _classify_exception(exc: BaseException) -> str | None:
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__}
    if "torch.OutOfMemoryError" in names or isinstance(exc, MemoryError):
        return "oom"
    return None


def device_cap(budget_device: int | None) -> int | None:
    """The CUDA memory a rank may use: its budget, capped by the emulated CI card if one is set."""
    return devices.device_memory_cap(budget_device)


def _load_main(main: dict[str, str]) -> None:
    """Make the launching script's ``__main__`` functions resolvable here.

    A ``python -m`` script is imported under its name; a ``python script.py`` file is run as
    ``__mp_main__`` (as multiprocessing's spawn does). Either way its ``if __name__ ==
    "__main__"`` block stays unrun, and ``__main__.fn`` in the pickled payload resolves to it.
    """
    if "module" in main:
        import importlib

        sys.modules["__main__"] = importlib.import_module(main["module"])
        return
    import runpy
    import types

    module = types.ModuleType("__mp_main__")
    module.__file__ = main["path"]
    sys.modules["__mp_main__"] = module
    module.__dict__.update(runpy.run_path(main["path"], run_name="__mp_main__"))
    sys.modules["__main__"] = module


def _watch(spec: dict[str, Any], rank: int) -> _Rank:
    """The rank's state with its stack dumps on and its host budget's watchdog running."""
    state = _Rank(spec, rank)
    faulthandler.enable(file=state.stacks, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=state.stacks, all_threads=True, chain=False)
    # A CUDA rank's RSS carries the driver, context and libraries on top of what the test uses.
    state.budget_host = devices.rank_host_budget(
        spec.get("budget_host_bytes"), spec["backend"], gpu_test=spec.get("gpu_test"), environ=os.environ
    )
    state.budget_device = spec.get("budget_device_bytes")
    if state.budget_host:
        state.watch_host_memory(state.budget_host)
    return state


def _set_up(spec: dict[str, Any], rank: int, state: _Rank) -> tuple[Any, tuple[Any, ...]]:
    """Threads, seeds, collective tracking, the test's function and the process group."""
    import torch
    import torch.distributed as dist

    # Before the test's module (and megatron-core with it) is imported: results are pickled
    # with torch's own storage loader, so reading them in pytest imports nothing new there.
    rank_result.keep_torch_storage_loader()
    # An idle rank's footprint (Python + torch): the launcher refuses smaller host budgets.
    state.idle_host_bytes = current_rss_bytes()
    torch.set_num_threads(spec["threads"])
    _seed_everything(spec["seed"] + rank)
    if spec.get("track_collectives", True):
        state.track_collectives()
    # A library's long-lived helpers (megatron-core's checkpoint writer) noted for the launcher,
    # which ends them with the rank without calling them the test's leak.
    library_helpers.track(
        library_helpers.entries_from_spec(spec.get("library_helpers")), state.run_dir / f"rank{rank}.helpers"
    )
    if spec.get("main"):
        _load_main(spec["main"])
    with open(spec["payload"], "rb") as f:
        fn, args = pickle.load(f)
    backend = spec["backend"]
    # KIT_DEVICE_MEMORY is the CI card's memory (set by the GPU job rows of ci/jobs.py): a
    # bigger local GPU is capped to it even for tests without a device budget.
    # NCCL: one device per rank, capped now; otherwise the cap waits for CUDA's first use,
    # so KIT_DEVICE_MEMORY alone never creates a CUDA context in a gloo rank.
    devices.apply_device_cap(rank, backend, device_cap(state.budget_device))
    from datetime import timedelta

    if spec.get("process_group", True):
        dist.init_process_group(
            backend,
            store=dist.FileStore(spec["store"], spec["world_size"]),
            rank=rank,
            world_size=spec["world_size"],
            timeout=timedelta(seconds=spec["pg_timeout_s"]),
        )
    # Without one of the kit's (the function makes its own, torchrun-style), the rank is set up now.
    with state.lock:  # the launcher's timeout counts from here (spawn and imports are load, not the test)
        state.ready, state.ready_at = True, time.time()
        state.waits.refresh()
        state.write_state()
    return fn, args


def _check_peaks(state: _Rank) -> None:
    """MemoryBudgetExceeded (a MemoryError) when the exact peaks (VmHWM, with the descendants' sampled sum) broke a budget."""
    state.memory.sample()  # the descendants still alive count once more, budget or not
    peak_host = max(peak_rss_bytes(), state.memory.peak)
    check_peaks(peak_host, peak_device_bytes(), state.budget_host, state.budget_device)


def _finish(state: _Rank, result: Any) -> None:
    """Leave the result, then leave the process group together with the peers."""
    import torch.distributed as dist

    with open(state.run_dir / f"rank{state.rank}.result", "wb") as f:
        rank_result.dump_result(result, f)
    if dist.is_initialized():
        if state.spec["world_size"] > 1:
            # Every rank past init and out of the function before any tears its group down: a
            # rank that finishes first (a function without collectives) would otherwise close
            # its sockets while a peer is still connecting to it. A peer that died makes this
            # fail fast (its sockets are closed), as a knock-on the diagnosis sees through.
            dist.barrier()
        dist.destroy_process_group()


def run(spec: dict[str, Any], rank: int) -> None:
    """Run ``fn(rank, world_size, *args)`` for this rank and exit; never returns."""
    state = _watch(spec, rank)
    try:
        fn, args = _set_up(spec, rank, state)
        state.in_function = True
        result = fn(rank, spec["world_size"], *args)
    except BaseException as exc:
        state.fail(exc, _classify_exception(exc))
        return
    try:
        _check_peaks(state)
        _finish(state, result)
    except BaseException as exc:
        state.fail(exc, "oom" if isinstance(exc, MemoryError) else None)
        return
    state.write_record("ok")
    _flush_and_exit(0)


def _open_standard_fds() -> None:
    """Open /dev/null on whichever of fds 0-2 is closed, before the rank opens its own files.

    A rank forked with its stdin closed handed fd 0 to its state file, and the first code that
    redirects stdin (pytest's capture in a per-test rank's session, a subprocess) pointed it at
    /dev/null: every later state line was lost and the stall rule saw no collective.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            opened = os.open(os.devnull, os.O_RDWR)
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)


def main() -> None:
    """Entry point: ``main()`` with ``KIT_RANK_SPEC`` and ``RANK`` in the environment."""
    _open_standard_fds()
    launcher = os.environ.get(LAUNCHER_ENV)
    _die_with_parent(int(launcher) if launcher and launcher.isdigit() else None)
    _adopt_orphans()
    with open(os.environ["KIT_RANK_SPEC"]) as f:
        spec = json.load(f)
    run(spec, int(os.environ["RANK"]))
