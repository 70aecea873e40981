"""`run_ranks`: run a function on N fresh ranks with a process group, and name the rank that failed.

Each call spawns ``world_size`` fresh Python processes (never forks the test process), each in
its own session so that its whole process tree can be killed. They rendezvous through a
FileStore in the launch's directory, so parallel pytest workers never compete for a port. The
parent polls them; the first failure tears the others down, and `megatron_testkit.diagnosis` turns what
they left behind into a `RankFailure` that leads with the root cause. Every process a launch starts
carries its marker (``KIT_RANK_SPEC``) in its environment, and each rank (and the launcher while
it launches) adopts the orphans below it (``PR_SET_CHILD_SUBREAPER``): whatever is left when the
launch ends, a double-forked daemon that cleared its environment included, is killed and counted
as leaked. Each rank's output goes through a pipe into its capped log (`megatron_testkit.rank_log`).

Under ``torchrun`` (RANK and WORLD_SIZE set by an elastic agent) nothing is spawned: the
function runs in this process on this rank, so the same tests run as multi-node jobs.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from megatron_testkit import (
    admission,
    attribution,
    cuda_context,
    devices,
    flight_recorder,
    heartbeat,
    kernel_log,
    library_helpers,
    machine_ledger,
    procfs,
    proctree,
    rank_log,
    rank_record,
    rank_worker,
    runner_limit,
    stall,
    wait_graph,
    warm_start,
)
from megatron_testkit.budgets import MemoryBudget, format_size
from megatron_testkit.diagnosis import (
    BudgetBelowFootprint,
    Evidence,
    RankFailure,
    RankRecord,
    judge,
    signal_name,
)
from megatron_testkit.memory_series import Sampler
from megatron_testkit.rank_log import CappedLog
from megatron_testkit.report_dir import in_report_folder
from megatron_testkit.safe_write import Folder
from megatron_testkit.schema import Run

__all__ = [
    "IDLE_FOOTPRINT",
    "BudgetBelowFootprint",
    "IdleFootprint",
    "RankFailure",
    "choose_backend",
    "cuda_device_count",
    "in_torchrun",
    "run_ranks",
]

# Seconds a launch may take when neither ``timeout=`` nor KIT_RANK_TIMEOUT says otherwise.
DEFAULT_TIMEOUT = 300.0
TIMEOUT_ENV = "KIT_RANK_TIMEOUT"
# After the first failure, how long the other ranks get to fail on their own (their knock-on
# errors are evidence) before the launcher dumps their stacks and kills them.
_GRACE_S = 1.0
_POLL_S = 0.05
# How often the launcher reads the ranks' positions (set-up done, collective, CPU) for stalls.
_POSITION_S = 0.25
_LOG_TAIL_LINES = 40

_BOOTSTRAP = (
    "import json, os, sys\n"
    # First of all, join the runner's memory cgroup (`python -m ci repro`), so that no memory the
    # rank touches is charged outside it (the repro's watcher would adopt it a poll later).
    "group = os.environ.get('KIT_RANK_CGROUP')\n"
    "if group:\n"
    "    try:\n"
    "        with open(os.path.join(group, 'cgroup.procs'), 'w') as f:\n"
    "            f.write(str(os.getpid()))\n"
    "    except OSError as exc:\n"
    "        print(f'kit: rank could not join the memory cgroup {group}: {exc}', file=sys.stderr)\n"
    "spec = json.load(open(os.environ['KIT_RANK_SPEC']))\n"
    "sys.path[:] = spec['sys_path'] + [p for p in sys.path if p not in spec['sys_path']]\n"
    "from megatron_testkit.rank_worker import main\n"
    "main()\n"
)


def check_timeout(value: Any, what: str = "timeout") -> float:
    """A launch timeout in seconds: a finite number above 0 (NaN would disable hang detection,
    infinity overflow the process group's timeout, 0 read as an instant hang); TypeError for
    what is not a number, ValueError for a number out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, got {value!r} ({type(value).__name__})")
    if not 0 < value < float("inf"):
        raise ValueError(f"{what} must be a finite number of seconds above 0, got {value!r}")
    return float(value)


def default_timeout(environ: dict[str, str] | None = None) -> float:
    """``KIT_RANK_TIMEOUT`` (checked by `check_timeout`), else `DEFAULT_TIMEOUT`; ValueError
    naming the variable for a value that is not a finite number of seconds above 0."""
    raw = (os.environ if environ is None else environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        return check_timeout(float(raw))
    except (TypeError, ValueError):
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r}: expected a finite number of seconds above 0, e.g. 300"
        ) from None


def check_world_size(value: Any) -> int:
    """A world size: a positive int (bool and float are refused); ValueError or TypeError else."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"world_size must be a positive int, got {value!r} ({type(value).__name__})")
    value = operator.index(value)
    if value < 1:
        raise ValueError(f"world_size must be >= 1, got {value}")
    return value


def in_torchrun() -> bool:
    """True in a process started by torchrun / torch.distributed.run (an elastic agent)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cuda_device_count() -> int:
    """Visible CUDA devices, without importing torch where there clearly are none."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(backend: str, world_size: int, gpu_test: bool | None = None) -> str:
    """``auto`` -> nccl with at least ``world_size`` GPUs, else gloo; a test not marked ``gpu``
    (``gpu_test=False``) always gets gloo (`devices.choose_backend`)."""
    gpus = cuda_device_count() if backend == "auto" and gpu_test is not False else 0
    return devices.choose_backend(backend, world_size, gpus=gpus, gpu_test=gpu_test)


def _check_picklable(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    qualname = getattr(fn, "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_ranks needs a module-level function (ranks are spawned and import it by name), "
            f"got {module}.{qualname}: move it to the top level of its module"
        )
    if module == "__main__" and _main_source() is None:
        raise TypeError(
            f"run_ranks cannot import {qualname} from __main__: it has neither a module name "
            f"(`python -m`) nor a script file (`python script.py`), e.g. an interactive session; "
            f"put the function in an importable module"
        )
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"run_ranks cannot send {module}.{qualname} and its args to the ranks "
            f"(spawned processes import the function by name and unpickle the args): {exc}"
        ) from exc


def _main_source() -> dict[str, str] | None:
    """Where the ranks find ``__main__``'s functions (which pickle as ``__main__.x``).

    ``{"module": name}`` for ``python -m name``; ``{"path": file}`` for ``python script.py``, which
    the ranks run as ``__mp_main__`` (its ``if __name__ == "__main__"`` block stays unrun), as
    ``torch.multiprocessing.spawn`` does; None when neither exists (an interactive session).
    """
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        return {"module": spec.name}
    path = getattr(main, "__file__", None)
    if path and os.path.isfile(path):
        return {"path": os.path.abspath(path)}
    return None


def _threads_per_rank(world_size: int) -> int:
    """Without a ledger: the cores split between this launch's ranks and the other xdist workers."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Also share the cores with the other xdist workers: oversubscription, not compute, is
    # what made 2-rank CPU runs several times slower in the measurements.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, cores // (world_size * max(1, workers)))


class IdleFootprint:
    """The smallest idle-rank footprint (Python + torch, before anything else) seen in this process.

    A later launch with a host budget below it is refused before anything is spawned.
    """

    def __init__(self) -> None:
        self.bytes: int | None = None

    def note(self, sizes: list[int]) -> None:
        """Take the footprints the ranks of one launch reported."""
        if sizes:
            self.bytes = min([*sizes, self.bytes or min(sizes)])

    def refuse_below(self, budget: MemoryBudget) -> None:
        """Raise `BudgetBelowFootprint` for a host budget below the known footprint."""
        if budget.host_bytes is not None and self.bytes is not None and budget.host_bytes < self.bytes:
            raise BudgetBelowFootprint(
                f"host memory budget {format_size(budget.host_bytes)} is below an idle rank's footprint "
                f"({format_size(self.bytes)}: Python and torch, measured in this session's earlier "
                f"launches) before the test's function would even start: raise memory_budget(host=...)"
            )


IDLE_FOOTPRINT = IdleFootprint()


def _run_dir(test_id: str | None, log_root: str | None) -> tuple[Path, bool]:
    """The launch's directory, and whether it is kept (True under --kit-report).

    Under --kit-report it is made in the session's folder by the kit's writer: atomically (two
    launches of one test id never share a directory) and never through a link.
    """
    if log_root:
        folder = Folder(log_root, what="the session's log folder")
        return folder.make_unique_dir(attribution.sanitise(test_id or "outside-pytest")), True
    scratch = attribution.scratch_root()
    if scratch:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="kit-ranks-", dir=scratch)), False


def _rank_env(env: dict[str, str], rank: int, world_size: int, spec_path: Path, threads: int) -> dict:
    child = dict(os.environ)
    # Not the session's ledger: a launch inside a rank would wait for the memory its parent holds.
    for key in (
        "PYTEST_XDIST_WORKER",
        "TORCHELASTIC_RUN_ID",
        "LOCAL_RANK",
        "GROUP_RANK",
        admission.LEDGER_ENV,
        machine_ledger.MACHINE_LEDGER_ENV,
    ):
        child.pop(key, None)
    child.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            runner_limit.LAUNCH_SPEC_ENV: str(spec_path),
            # The rank checks that this process is still its parent once it asked to die with it.
            rank_worker.LAUNCHER_ENV: str(os.getpid()),
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
        }
    )
    # Inductor compiles in the rank itself, not in a pool of workers: the pool's sidecar is shut
    # down by an atexit handler, which a rank (ended by os._exit) never runs, so it outlived the
    # rank as a leaked process. Read when torch._inductor.config is imported; the session's or the
    # test's own setting wins.
    child.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    child.update({k: str(v) for k, v in env.items()})
    return child


@dataclass
class _RankProcess:
    """One spawned rank as the parent sees it while it runs."""

    rank: int
    proc: subprocess.Popen
    log: CappedLog
    status: str = "running"  # running, ok, failed, torn_down, hung
    exit_time: float | None = None
    sampled_peak: int | None = None
    peak_process: str | None = None  # the descendant that held most at the sampled tree peak
    rss: int | None = None  # the rank's tree, sampled each poll under KIT_HOST_MEMORY
    descendants: list[tuple[int, int]] = field(default_factory=list)  # (pid, RSS) at that sample

    def poll(self, sample_rss: bool = False, record: Path | None = None) -> bool:
        """Sample the peak (and the RSS); note an exit. True when the rank has just failed.

        A rank that exits with status 0 has finished only if it left its ``record`` (the worker
        writes it just before exiting): ``os._exit(0)`` inside the function is a failure.
        """
        peak = procfs.peak_rss_bytes(self.proc.pid)
        if peak is not None:
            self.sampled_peak = max(peak, self.sampled_peak or 0)
        if sample_rss:
            self.sample_tree()
        rc = self.proc.poll()
        if rc is None:
            return False
        self.exit_time = time.time()
        finished = rc == 0 and (record is None or record.exists())
        self.status = "ok" if finished else "failed"
        return not finished

    def sample_tree(self) -> None:
        """The rank's RSS with its descendants' (its worker processes count against the runner's
        memory as its own); a new tree peak remembers the descendant that held most."""
        tree = procfs.tree_rss(self.proc.pid)
        self.rss, self.descendants = (None, []) if tree is None else tree
        if self.rss is not None and self.rss > (self.sampled_peak or 0):
            self.sampled_peak = self.rss
            if self.descendants:
                pid, size = max(self.descendants, key=lambda part: part[1])
                self.peak_process = f"{procfs.command_line(pid)} held {format_size(size)}"

    def record(self, run_dir: Path) -> RankRecord:
        """Everything the rank left behind (its record, state, stacks, log), as a `RankRecord`."""
        rc = self.proc.returncode
        rec = RankRecord(rank=self.rank, status=self.status, pid=self.proc.pid)
        rec.exit_code = rc if rc is not None and rc >= 0 else None
        rec.signal = signal_name(rc)
        rec.time = self.exit_time
        rec.log_path = str(run_dir / f"rank{self.rank}.log")
        rec.peak_host_bytes = self.sampled_peak
        rec.peak_process = self.peak_process
        written = rank_record.read(run_dir / rank_record.record_name(self.rank))
        if rc == 0 and not isinstance(written, rank_record.WrittenRecord):
            # Exited with status 0 but never got to write its record: it did not return.
            rec.status = "failed"
        if isinstance(written, rank_record.Unreadable):
            rec.status = "failed" if rec.status == "ok" else rec.status
            rec.unreadable = written.why
        elif written is not None:
            rec.take(written)
        else:
            self._take_state(run_dir, rec)
        with contextlib.suppress(OSError), open(run_dir / f"rank{self.rank}.stacks", "rb") as f:
            rec.stack = f.read(rank_record.MAX_TEXT).decode(errors="replace").strip() or None
        # A rank killed without a record (NCCL's watchdog aborts with SIGABRT) is diagnosed
        # from what it printed last; the message shows every rank's last lines on failure.
        rec.log_tail = "\n".join(self.log.tail_text().splitlines()[-_LOG_TAIL_LINES:])
        killed = runner_limit.read_memory_kill(run_dir, self.rank)
        if killed is not None and rec.status == "failed" and not rec.exc_type:
            # Killed for the runner's memory by the launcher or by `ci repro`'s watcher, who said so first.
            rec.exc_type, rec.exc_message, rec.kind_hint = _RUNNER_OOM, killed, "oom"
        return rec

    def _take_state(self, run_dir: Path, rec: RankRecord) -> None:
        """Without a record, where the rank was from its state line: its last collective, when it was set up."""
        with contextlib.suppress(OSError, ValueError):
            with open(run_dir / f"rank{self.rank}.state", "rb") as f:
                state = json.loads(f.read(4096).decode(errors="replace").strip() or "{}")
            if isinstance(state, dict):
                last, seq = state.get("last_collective"), state.get("seq")
                rec.last_collective = last if isinstance(last, str) else None
                rec.collective_seq = seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
                ready = state.get("ready_at")
                rec.ready_at = (
                    ready if isinstance(ready, int | float) and not isinstance(ready, bool) else None
                )


class _Launch:
    """One `run_ranks` call: its directory, spec and ranks, from spawn to verdict and report row."""

    def __init__(
        self,
        fn: Callable[..., Any],
        world_size: int,
        *,
        backend: str,
        timeout: float,
        args: Sequence[Any],
        env: dict[str, str] | None,
        budget: MemoryBudget | None,
        stall_window: float | str | None = "default",
    ) -> None:
        payload = _check_picklable(fn, args)
        # The runner's memory: enforced here on the ranks' summed RSS (KIT_HOST_MEMORY), or by the
        # kernel in the ranks' cgroup (KIT_RANK_CGROUP), whose OOM counter is read before and after.
        # Read first: a malformed value is refused before anything is made.
        self.host_limit = runner_limit.host_memory_limit()
        context = attribution.current()
        self.fn, self.world_size, self.timeout = fn, world_size, timeout
        self._settle(context, backend, budget, stall_window)
        self._join_ledgers()
        self._make_folder(context, payload, env)
        self._watch_cgroup()
        self._start_bookkeeping(context)
        self.started = time.time()

    def _settle(
        self,
        context: attribution.TestContext | None,
        backend: str,
        budget: MemoryBudget | None,
        stall_window: float | str | None,
    ) -> None:
        """The test this launch runs for, its budget (refused below a known idle footprint), its
        stall window and its backend."""
        self.in_test = attribution.current_test_id() is not None
        self.test_id = (
            attribution.current_test_id() or f"{getattr(self.fn, '__module__', '?')}.{self.fn.__qualname__}"
        )
        if budget is None and context is not None:
            budget = context.budget
        self.budget = budget or MemoryBudget()
        IDLE_FOOTPRINT.refuse_below(self.budget)
        # The stall window: the argument, else the test's stall_window marker, else KIT_STALL_WINDOW.
        if stall_window == "default":
            stall_window = (
                context.stall_window
                if context is not None and context.stall_window != "default"
                else stall.default_window()
            )
        self.stall_window = stall.check_window(stall_window)
        # Marked `gpu` or not (None outside a test): only `gpu` tests get NCCL and see the GPUs.
        self.gpu_test = context.gpu if context is not None else None
        self.backend = choose_backend(backend, self.world_size, self.gpu_test)

    def _join_ledgers(self) -> None:
        """The session's ledger and, for a top-level session, the machine's (one per user and boot);
        a launch that could never fit is refused before anything is made: it could only wait forever."""
        self.ledger = admission.session_ledger()
        self.machine = machine_ledger.launch_ledger() if self.ledger is not None else None
        if self.ledger is not None:
            self.ledger.refuse_never_fits(self.admission_share(), self.world_size, self.test_id)

    def _make_folder(
        self, context: attribution.TestContext | None, payload: bytes, env: dict[str, str] | None
    ) -> None:
        """The launch's folder with the pickled payload, where its logs are shown, the ranks' environment."""
        # The process group times out before the launch does, so NCCL's watchdog writes its flight
        # recorder while the launcher still waits; gloo gets the same margin.
        self.pg_timeout = max(5.0, min(self.timeout * 0.8, self.timeout - 10.0))
        self.seed = attribution.seed_for(self.test_id)
        log_root = context.log_root if context else attribution.log_root()
        self.run_dir, self.keep = _run_dir(self.test_id, log_root)
        # Where people and reports find the logs: relative to the --kit-report folder, so that a
        # downloaded artifact resolves it (the absolute path stays in RankFailure.log_dir).
        self.rank_logs = in_report_folder(self.run_dir, log_root)
        self.memory = Sampler(time.monotonic())  # restarted at spawn: times count from there
        self.shown_logs = (
            f"{self.rank_logs} (in the --kit-report folder)" if self.rank_logs else str(self.run_dir)
        )
        (self.run_dir / "payload.pkl").write_bytes(payload)
        self.spec_path = self.run_dir / "spec.json"
        # NCCL: flight recorder on, dumps and dump-request pipes in the launch's directory.
        self.env = flight_recorder.nccl_env(self.run_dir) if self.backend == "nccl" else {}
        self.env.update(devices.rank_device_env(self.backend, gpu_test=self.gpu_test))
        # megatron's groups take this timeout (fixtures.megatron.init_model_parallel), not 30 minutes.
        self.env[flight_recorder.PG_TIMEOUT_ENV] = str(self.pg_timeout)
        self.env.update(env or {})

    def _watch_cgroup(self) -> None:
        """The memory cgroup whose OOM kills name ranks as ``oom``, and its counters before the launch."""
        self.rss_before: dict[int, int] = {}
        # Without a ranks' cgroup, the ranks share this process's own memory cgroup (a container's,
        # a CI job's): a kernel OOM kill there is read from its oom_kill counter alone.
        group = os.environ.get(runner_limit.RANK_CGROUP_ENV)
        self.cgroup = Path(group) if group else runner_limit.memory_cgroup_of()
        self.own_cgroup = not group  # decided once: the counters read before and after must match
        self.cgroup_role = (
            "the launcher's own memory cgroup" if self.own_cgroup else "the ranks' memory cgroup"
        )
        self.oom_before = self._oom_counters()

    def _start_bookkeeping(self, context: attribution.TestContext | None) -> None:
        """What the launch keeps while it runs: its ranks and their helpers, tickets, positions."""
        self.ranks: list[_RankProcess] = []
        self.helpers: dict[int, psutil.Process] = {}
        self.ticket: admission.Ticket | None = None
        self.machine_ticket: admission.Ticket | None = None
        self.last_dump_request = 0.0
        self.fr_cache: dict[int, Any] = {}  # each rank's last flight-recorder reading, by its file's stat
        self.stall_verdict: stall.Stall | None = None
        # What the heartbeat reports: the phase, then each rank's last position and since when.
        self.phase = "queued for admission" if self.ledger is not None else "starting ranks"
        self.last_positions: dict[int, stall.Position] = {}
        self.seen: dict[int, tuple[Any, float]] = {}
        self.beat_cpu: dict[int, tuple[float, float]] = {}
        self.subreaper = False  # this process adopts orphans from `start` to `close`
        self.fresh_interpreter = bool(getattr(context, "fresh_interpreter", False))
        # Warm (forked from the warm parent) or cold (spawned), and why; decided in `start`.
        self.start_mode: str | None = None
        self.start_reason: str | None = None
        self.children_before: set[int] = set()
        self.process_group = True  # the ranks' default group is the kit's (False: fn makes its own)
        # When the wait for admission began, and how long it took (the heartbeat states it).
        self.admit_started: float | None = None
        self.admitted_after: float | None = None

    def queued_so_far(self) -> float:
        """Seconds this launch has waited for admission so far (0 before it asked)."""
        if self.admit_started is None:
            return 0.0
        if self.admitted_after is not None:
            return self.admitted_after
        return time.monotonic() - self.admit_started

    def admission_share(self) -> int:
        """The bytes this launch's ranks take in the session's ledger: their host budgets (the CUDA
        host allowance included), or the default per rank for a test that declares none."""
        per_rank = devices.rank_host_budget(self.budget.host_bytes, self.backend, gpu_test=self.gpu_test)
        return (per_rank or admission.default_rank_bytes()) * self.world_size

    def admit(self) -> int:
        """Wait for the ledger to admit this launch (`admission.NeverFits` at once if it cannot);
        the threads per rank: the free cores split between its ranks."""
        if self.ledger is None:
            return _threads_per_rank(self.world_size)
        self.ticket = self.ledger.admit(self.admission_share(), self.world_size, self.test_id)
        # Carried by the ranks and whatever they start: if this process dies unreaped, whoever
        # reclaims its share finds and ends them by it (`admission.Ledger`).
        self.env[admission.TICKET_ENV] = self.ticket.marker
        if self.machine is not None:  # second, always: no two launches wait for each other in turn
            self.machine_ticket = self.machine.admit_within(
                self.admission_share(), self.world_size, self.test_id
            )
            self.env[machine_ledger.MACHINE_TICKET_ENV] = self.machine_ticket.marker
        return self.ticket.threads

    def queued_s(self) -> float | None:
        """Seconds the launch waited for admission: its session's ledger, then the machine's."""
        if self.ticket is None:
            return None
        machine = self.machine_ticket.queued_s if self.machine_ticket is not None else 0.0
        return round(self.ticket.queued_s + machine, 3)

    def _spec(self, fn: Callable[..., Any], threads: int) -> dict[str, Any]:
        """What every rank reads at start (``rank_worker.run``)."""
        sys_path = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
        package_root = str(Path(__file__).resolve().parent.parent)
        if package_root not in sys_path:
            sys_path.append(package_root)
        return {
            "world_size": self.world_size,
            "backend": self.backend,
            "run_dir": str(self.run_dir),
            "store": str(self.run_dir / "filestore"),
            "payload": str(self.run_dir / "payload.pkl"),
            "pg_timeout_s": self.pg_timeout,
            "seed": self.seed,  # rank r seeds random, numpy and torch with seed + r
            "gpu_test": self.gpu_test,
            "threads": threads,
            "budget_host_bytes": self.budget.host_bytes,
            "budget_device_bytes": self.budget.device_bytes,
            "sys_path": sys_path,
            "track_collectives": os.environ.get("KIT_TRACK_COLLECTIVES", "1") != "0",
            "library_helpers": library_helpers.spec_entries(),
            "process_group": self.process_group,
            "main": _main_source() if getattr(fn, "__module__", None) == "__main__" else None,
        }

    def start(self) -> None:
        """Once admitted, spawn every rank in its own session, its output going through a pipe to ``rank<N>.log``
        (capped: `megatron_testkit.rank_log`); from now until `close` this process adopts the
        orphans the ranks leave (`proctree.hold_subreaper`)."""
        self.admit_started = time.monotonic()
        threads = self.admit()
        self.admitted_after = time.monotonic() - self.admit_started
        self.phase = "starting ranks"
        self.spec_path.write_text(json.dumps(self._spec(self.fn, threads)))
        self.spawned, self.spawned_at = time.monotonic(), time.time()
        self.memory.started = self.spawned
        envs = [
            _rank_env(self.env, rank, self.world_size, self.spec_path, threads)
            for rank in range(self.world_size)
        ]
        # Before this process adopts orphans: a warm parent started now is no orphan of the launch.
        plan = warm_start.plan(envs[0], fresh_interpreter=self.fresh_interpreter, fn=self.fn)
        self.start_mode, self.start_reason = plan.mode, plan.reason
        # The start-up timeout counts from here: a wait for a warm parent still importing is not the ranks'.
        self.forking = time.monotonic()
        cap = rank_log.log_cap()
        proctree.hold_subreaper()
        self.subreaper = True
        self.children_before = set(procfs.children())
        folder = Folder(self.run_dir, create=False, what="the launch's folder")
        for rank in range(self.world_size):
            log = CappedLog(folder.open_new(f"rank{rank}.log"), cap, rank)
            tag = f"kit-rank-{rank}-of-{self.world_size}"  # names the rank in `ps` output
            try:
                proc: subprocess.Popen | warm_start.ForkedRank | None = None
                if plan.parent is not None:
                    proc = self._fork(plan.parent, envs[rank], log, tag, rank)
                    if proc is None:
                        plan = warm_start.StartPlan(None, self.start_reason)
                if proc is None:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _BOOTSTRAP, tag],
                        stdin=subprocess.DEVNULL,
                        stdout=log.write_fd,
                        stderr=subprocess.STDOUT,
                        env=envs[rank],
                        start_new_session=True,
                    )
            except BaseException:
                log.close()
                raise
            log.started()
            self.ranks.append(_RankProcess(rank, proc, log))  # type: ignore[arg-type]

    def _fork(
        self, parent: warm_start.WarmParent, env: dict[str, str], log: CappedLog, tag: str, rank: int
    ) -> warm_start.ForkedRank | None:
        """One rank forked by the warm parent (which is then the parent it checks for); None when the
        parent refuses, and this rank and the rest start cold, the reason recorded."""
        try:
            return parent.fork(
                {**env, rank_worker.LAUNCHER_ENV: str(parent.pid)}, log.write_fd, str(self.spec_path), tag
            )
        except warm_start.WarmRefused as exc:
            self.start_mode = "cold" if rank == 0 else "mixed"
            self.start_reason = f"the warm parent refused rank {rank}: {exc}"
            return None

    def supervise(self) -> bool:
        """Poll the ranks until all exit, one fails (plus a grace), the ranks deadlock (every live one
        blocked for the stall window) or the timeout, counted from when every rank's process group is
        up (spawn and imports are the machine's load, not the test's; they get a timeout of their
        own); True on a hang."""
        __tracebackhide__ = True  # an interrupt (pytest-timeout) lands here: show the test, not this
        deadline = self.forking + self.timeout
        ready_at: float | None = None
        first_failure: float | None = None
        last_scan = last_position = 0.0
        detector = self.stall_detector()
        while True:
            now = time.monotonic()
            for r in self.running():
                record = self.run_dir / rank_record.record_name(r.rank)
                if r.poll(sample_rss=self.host_limit is not None, record=record) and first_failure is None:
                    first_failure = now
                if r.status != "running" and detector is not None:
                    detector.rank_exited(r.rank)
            if self.host_limit is not None:
                self.enforce_host_limit(self.host_limit)
            if self.memory.due(now):  # each rank's memory over time, for the report's charts
                for r in self.running():
                    self.memory.add(r.rank, now, r.rss if r.rss is not None else procfs.rss_bytes(r.proc.pid))
            if now - last_scan > 0.5:
                last_scan = now
                self.scan_trees()
            running = self.running()
            if not running:
                return False
            if first_failure is not None and now - first_failure > _GRACE_S:
                self.stop(running, "torn_down")
                return False
            if now - last_position > _POSITION_S:
                last_position = now
                positions = self.positions(running)
                self.note_positions(now, positions)
                if (
                    ready_at is None
                    and len(positions) == len(running)
                    and all(p.ready for p in positions.values())
                ):
                    ready_at = now
                    deadline = max(deadline, ready_at + self.timeout)
                if detector is not None:
                    for r in running:
                        detector.observe(now, r.rank, positions.get(r.rank))
                    self.stall_verdict = detector.verdict(now, [r.rank for r in running])
                    if self.stall_verdict is not None:
                        self.stop(running, "hung")
                        return True
            if now > deadline:
                self.stop(running, "hung")
                return True
            time.sleep(_POLL_S)

    def note_positions(self, now: float, positions: dict[int, stall.Position]) -> None:
        """Keep the ranks' positions, and since when each is where it is, for the heartbeat."""
        self.phase = "running"
        for rank, p in positions.items():
            key = p.waits.key() if p.waits is not None else p.inside
            if self.seen.get(rank, (object(), 0.0))[0] != key:
                self.seen[rank] = (key, now)
        self.last_positions = positions

    def progress(self) -> str:
        """The heartbeat's status: the phase, or where each rank is (`megatron_testkit.heartbeat`)."""
        if self.phase != "running":
            return self.phase
        now = time.monotonic()
        positions, seen = dict(self.last_positions), dict(self.seen)
        by_state: dict[str, list[int]] = {}
        longest: dict[str, float] = {}
        for r in self.ranks:
            p = positions.get(r.rank)
            if r.status != "running":
                what = "exited"
            elif p is None or not p.ready:
                what = "starting"
            elif p.waits is not None and p.waits.main is not None:
                what = f"in {wait_graph.describe(p.waits.main, p.waits.groups)}"
            elif p.waits is None and p.inside is not None:
                what = f"in {p.inside}"
            else:
                what = self._cpu_state(r.rank, now, p.work)
            by_state.setdefault(what, []).append(r.rank)
            if (
                p is not None
                and r.rank in seen
                and what not in ("exited", "starting")
                and what not in _USER_CODE
            ):
                longest[what] = max(longest.get(what, 0.0), now - seen[r.rank][1])
        parts = []
        for what, ranks in by_state.items():
            held = f" for {longest[what]:.0f} s" if what in longest else ""
            parts.append(f"{heartbeat.ranks_text(ranks)} {what}{held}")
        return ", ".join(parts)

    def _cpu_state(self, rank: int, now: float, work: float | None) -> str:
        """``computing`` when the rank used a tenth of a core since the last line, else user code."""
        before = self.beat_cpu.get(rank)
        if work is not None:
            self.beat_cpu[rank] = (work, now)
        if work is None or before is None or now <= before[1]:
            return "in user code"
        return "computing" if (work - before[0]) / (now - before[1]) >= 0.1 else "idle in user code"

    def stall_detector(self) -> stall.StallDetector | None:
        """The launch's deadlock watch (None with the stall window off); NCCL ranks are judged by
        their flight recorders' progress, the others by the host's view."""
        if self.stall_window is None:
            return None
        if self.backend == "nccl":
            return stall.StallDetector(self.stall_window, min_work=0.5)
        return stall.StallDetector(self.stall_window)

    def positions(self, running: list[_RankProcess]) -> dict[int, stall.Position]:
        """Each running rank's position (its state line and CPU; on NCCL, its flight recorder's where
        it has a dump: `stall.with_flight_recorder`)."""
        out = {}
        for r in running:
            position = stall.read_position(self.run_dir, r.rank, r.proc.pid)
            if position is not None:
                out[r.rank] = position
        if self.backend == "nccl" and self.stall_window is not None:
            stem = self.run_dir / flight_recorder.DUMP_STEM
            now = time.monotonic()
            if now - self.last_dump_request > max(1.0, self.stall_window / 4):  # a dump costs the rank
                self.last_dump_request = now
                flight_recorder.request_dumps(stem, [r.rank for r in running])  # read at a later poll
            # Group ranks the dumps lack, from the ranks' state lines (the wrappers note each group's).
            groups = {g: m for p in out.values() if p.waits is not None for g, m in p.waits.groups.items()}
            recorded = stall.nccl_positions(stem, out, groups, self.fr_cache)
            out = stall.with_flight_recorder(out, recorded)
        return out

    def scan_trees(self) -> None:
        """Remember helpers that might leave the rank's process group before it dies, and sample
        each running rank's tree for its peak (its worker processes' memory is its own)."""
        for r in self.ranks:
            for child in proctree.descendants(r.proc.pid):
                self.helpers.setdefault(child.pid, child)
        for pid in self._adopted():  # orphans of a rank that died, re-parented to this process
            with contextlib.suppress(psutil.Error):
                self.helpers.setdefault(pid, psutil.Process(pid))
        if self.host_limit is None:  # with a limit, every poll samples the trees already
            for r in self.running():
                r.sample_tree()

    def enforce_host_limit(self, limit: int) -> None:
        """Kill the rank that pushed the running ranks' summed memory (each rank with its
        descendants) over the runner's memory; its note says so before it dies."""
        current = {r.rank: r.rss for r in self.running() if r.rss is not None}
        culprit = runner_limit.rank_over_limit(self.rss_before, current, limit)
        self.rss_before = current
        if culprit is None:
            return
        r = self.ranks[culprit]
        held = f" (with {len(r.descendants)} descendant process(es))" if r.descendants else ""
        runner_limit.note_memory_kill(
            self.run_dir,
            culprit,
            f"the ranks' summed RSS {format_size(sum(current.values()))} > {format_size(limit)} "
            f"(KIT_HOST_MEMORY, the runner's memory); rank {culprit} grew most and was killed by the "
            f"launcher at RSS {format_size(current[culprit])}{held}",
        )
        proctree.signal_group(r.proc.pid, signal.SIGKILL)
        self.rss_before.pop(culprit, None)

    def name_runner_ooms(self, records: list[RankRecord]) -> None:
        """Mark the ranks the runner's memory limit killed as ``oom``, saying how it was seen.

        A rank the launcher or `ci repro` killed left a note that says so (read with its record); in
        the ranks' cgroup, ranks killed by SIGKILL while the group's OOM counter rose are the kernel
        OOM killer's, earliest first; so is a SIGKILLed rank whose pid the kernel's log records as
        an OOM kill since the launch (`megatron_testkit.kernel_log`).
        """
        self._name_cgroup_ooms(records)
        self._name_kernel_ooms(records)

    def _name_kernel_ooms(self, records: list[RankRecord]) -> None:
        """Ranks killed by SIGKILL that the kernel's log records as OOM kills since the launch."""
        killed = {
            rec.pid: rec
            for rec in records
            if rec.status == "failed" and rec.signal == "SIGKILL" and not rec.exc_type and rec.pid is not None
        }
        if not killed:
            return
        for pid, line in kernel_log.oom_kill_records(killed, since=self.spawned).items():
            rec = killed[pid]
            rec.exc_type, rec.kind_hint = _RUNNER_OOM, "oom"
            rec.exc_message = f"killed by the kernel OOM killer (the kernel's log: {line})"

    def _name_cgroup_ooms(self, records: list[RankRecord]) -> None:
        """Ranks killed by SIGKILL while the ranks' cgroup's OOM counter rose, earliest first."""
        if self.cgroup is None or self.oom_before is None:
            return
        killed = [
            rec for rec in records if rec.status == "failed" and rec.signal == "SIGKILL" and not rec.exc_type
        ]
        seen = runner_limit.oom_kills_between(self.oom_before, self._oom_counters())
        if not killed or seen is None:
            return
        count, note = seen
        limit = runner_limit.group_limit_bytes(self.cgroup)
        for rec in sorted(killed, key=lambda rec: (rec.time or 0.0, rec.rank))[:count]:
            rec.exc_type, rec.kind_hint = _RUNNER_OOM, "oom"
            rec.exc_message = (
                f"killed by the kernel OOM killer in {self.cgroup_role} {self.cgroup} ({note}; "
                f"limit {format_size(limit)}, rank {rec.rank}'s peak RSS {format_size(rec.peak_host_bytes)})"
            )

    def _oom_counters(self) -> runner_limit.OomCounters | None:
        """The group's OOM counters; in the launcher's own, shared group (no KIT_RANK_CGROUP) its
        local kills only and no failcnt, which rises there on page-cache reclaim alone."""
        if self.cgroup is None:
            return None
        if not self.own_cgroup:
            return runner_limit.read_oom_counters(self.cgroup)
        # The own group: its own kills only (other launches' rank groups may be its children).
        counters = runner_limit.read_oom_counters(self.cgroup, local=True)
        return runner_limit.OomCounters(counters.oom_kill, None, counters.source)

    def running(self) -> list[_RankProcess]:
        """The ranks still running."""
        return [r for r in self.ranks if r.status == "running"]

    def stop(self, ranks: list[_RankProcess], status: str) -> None:
        """Ask the given ranks for a flight-recorder dump (NCCL) and a stack dump, then kill them."""
        __tracebackhide__ = True  # an interrupt (pytest-timeout) lands here: show the test, not this
        if self.backend == "nccl" and ranks:
            # NCCL's monitor thread serves the request within a poll; only ranks with a pipe are
            # waited for, at most flight_recorder.DUMP_WAIT_S.
            outcome = flight_recorder.dump_before_kill(
                self.run_dir / flight_recorder.DUMP_STEM, [r.rank for r in ranks]
            )
            with contextlib.suppress(OSError):
                (self.run_dir / "flight_recorder.json").write_text(json.dumps(outcome))
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(r.proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        for r in ranks:
            proctree.signal_group(r.proc.pid, signal.SIGKILL)
            r.status = status
        for r in ranks:
            with contextlib.suppress(Exception):
                r.proc.wait(timeout=5)

    def interrupted(self, exc: BaseException) -> None:
        """Interrupted from outside (Ctrl-C, pytest-timeout): note where every rank was."""
        running = self.running()
        with contextlib.suppress(BaseException):
            self.stop(running, "torn_down")
            stacks = []
            for r in running:
                with contextlib.suppress(OSError), open(self.run_dir / f"rank{r.rank}.stacks", "rb") as f:
                    text = f.read(rank_record.MAX_TEXT).decode(errors="replace").strip()
                    stacks.append(f"rank {r.rank}:\n{text}")
            if stacks and hasattr(exc, "add_note"):
                exc.add_note(
                    f"run_ranks was interrupted; rank logs in {self.shown_logs}; stacks:\n"
                    + "\n".join(stacks)
                )

    def diagnose(self, records: list[RankRecord], hung: bool) -> RankFailure | None:
        """The launch's verdict (`diagnosis.judge`): None when every rank returned, else the
        `RankFailure` to raise; `BudgetBelowFootprint` for a rank's startup over the host budget."""
        return judge(
            records,
            Evidence(
                hung=hung,
                stall=self.stall_verdict,
                host_budget=self.budget.host_bytes,
                timeout=self.timeout,
                started=self.started,
                shown_logs=self.shown_logs,
                log_dir=str(self.run_dir),
                dumps=self.run_dir / flight_recorder.DUMP_STEM,
                # Same test id, same seeds: this replays the launch as it ran.
                repro=(
                    f"KIT_SEED={self.seed} python -m pytest '{self.test_id}' "
                    f"(world_size={self.world_size}, backend={self.backend})"
                    if self.in_test
                    else None
                ),
            ),
        )

    def results(self, records: list[RankRecord]) -> list[Any] | RankFailure:
        """Every rank's return value, in rank order; a `RankFailure` naming a rank that left none."""
        out = []
        # A CUDA tensor in a result creates a CUDA context here: the kit's doing, not the test's.
        cuda_context.observe(cuda_context.TEST, cuda_context.current_test())
        for r, rec in zip(self.ranks, records, strict=True):
            try:
                with open(self.run_dir / f"rank{r.rank}.result", "rb") as f:
                    out.append(pickle.load(f))
                cuda_context.observe(cuda_context.KIT, cuda_context.current_test())
            except Exception as exc:  # unpickling runs the result's own code: anything can fail
                rec.status, rec.exc_type = "failed", type(exc).__name__
                rec.exc_message = f"rank {r.rank} finished but its result could not be read here: {exc}"
                failure = self.diagnose(records, hung=False)
                assert failure is not None
                return failure
        return out

    def _adopted(self) -> list[int]:
        """Processes re-parented to this one during the launch (orphans of its ranks' trees), and
        those the warm parent adopted from forked ranks and handed over."""
        handed = [
            pid for r in self.ranks if isinstance(r.proc, warm_start.ForkedRank) for pid in r.proc.adopted()
        ]
        if not self.subreaper:
            return handed
        return [*proctree.adopted_since(self.children_before, {r.proc.pid for r in self.ranks}), *handed]

    def close(self) -> int:
        """Kill whatever is left of the ranks' trees, close the logs, give the launch's memory back
        to the ledger; how many helpers leaked.

        Left: the ranks' process groups, the helpers seen in their trees, orphans re-parented to
        this process (it is a subreaper while it launches: a process cannot opt out by leaving its
        group or clearing its environment), and what still carries the launch's marker.
        """
        marked = proctree.marked(runner_limit.LAUNCH_SPEC_ENV, str(self.spec_path))
        adopted = self._adopted()
        found = [*self.helpers.values(), *marked]
        for pid in adopted:
            with contextlib.suppress(psutil.Error):
                found.append(psutil.Process(pid))
        # A library's helpers kept for the rank's life (megatron-core's checkpoint writer) end
        # with it, but are not the test's leak: the ranks noted them, or the ini declares their command.
        kept = library_helpers.Kept(library_helpers.read_helpers(self.run_dir, self.world_size))
        try:
            leaked = proctree.kill_tree([r.proc.pid for r in self.ranks], found, kept=kept)
            library_helpers.warn(kept.seen)
            for r in self.ranks:
                with contextlib.suppress(Exception):
                    r.proc.wait(timeout=5)
            proctree.reap([*adopted, *self._adopted()])  # no zombie of theirs is left here
        finally:
            for r in self.ranks:
                if isinstance(r.proc, warm_start.ForkedRank):
                    r.proc.release()
            if self.subreaper:
                self.subreaper = False
                proctree.release_subreaper()
            for r in self.ranks:
                r.log.close()
            if self.ticket is not None and self.ledger is not None:
                self.ledger.release(self.ticket)
            if self.machine_ticket is not None and self.machine is not None:
                self.machine.release(self.machine_ticket)
        return leaked

    def setup_s(self, records: list[RankRecord]) -> float | None:
        """Seconds from spawn until the last rank's process group was up (None if one never got there)."""
        ready = [r.ready_at for r in records]
        if not records or not all(isinstance(t, (int, float)) for t in ready):
            return None
        return round(max(ready) - self.spawned_at, 3)

    def report(self, records: list[RankRecord], failure: BaseException | None, leaked: int) -> None:
        """Attribute the launch to the running test and keep or remove its directory."""
        IDLE_FOOTPRINT.note([r.idle_host_bytes for r in records if r.idle_host_bytes])
        from megatron_testkit.megatron_cpu import add_substitutions

        for r in records:  # the CPU layer's substitutions in the ranks count as this process' own
            add_substitutions(r.cpu_substitutions)
        attribution.record_run(
            Run(
                world_size=self.world_size,
                backend=self.backend,
                started=self.started,
                seed=self.seed,
                duration_s=time.time() - self.started,
                log_dir=str(self.run_dir) if self.keep or failure else None,
                rank_logs=self.rank_logs if self.keep or failure else None,
                memory=self.memory.series() if self.memory.ranks else None,
                ranks=[r.peak() for r in records],
                failure=failure.to_failure() if isinstance(failure, RankFailure) else None,
                leaked_processes=leaked,
                device=next((r.device for r in records if r.device), None),
                platform=next((r.platform for r in records if r.platform), None),
                queued_s=self.queued_s(),
                admitted_bytes=self.ticket.bytes if self.ticket is not None else None,
                setup_s=self.setup_s(records),
                start_mode=self.start_mode,
                start_reason=self.start_reason,
            )
        )
        if not self.keep and failure is None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        else:
            # Kept for people and CI artifacts: logs, records, stacks; not the pickled payload and
            # results, which can be large.
            for path in [self.run_dir / "payload.pkl", *self.run_dir.glob("rank*.result")]:
                path.unlink(missing_ok=True)


# The heartbeat's words for a rank outside any collective (no "for N s": it is not waiting).
_USER_CODE = frozenset({"in user code", "computing", "idle in user code"})

# How a rank killed for the runner's memory (not its own budget) is named in its record.
_RUNNER_OOM = "megatron_testkit.RunnerMemoryExceeded"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "auto",
    timeout: float | None = None,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    budget: MemoryBudget | None = None,
    stall_window: float | str | None = "default",
    process_group: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks; return their results.

    The default process group is initialised before ``fn`` and destroyed after it. ``backend``
    is ``auto`` (NCCL with at least ``world_size`` GPUs, else gloo), ``gloo`` or ``nccl``.
    ``timeout`` (seconds, finite and above 0; default ``KIT_RANK_TIMEOUT`` or 300) bounds the
    launch from the moment every rank's process group is up (and, separately, the ranks' set-up
    from spawn); past it every rank's Python stack is dumped and the launch fails as a hang. ``env`` adds environment variables for the ranks.
    ``budget`` overrides the test's ``memory_budget`` marker. ``stall_window`` (seconds, or None
    for off; default the test's ``stall_window`` marker, else ``KIT_STALL_WINDOW``, else 30 s): when
    ranks have waited for each other in collectives that long (a cycle on the wait-for graph, a
    wait on an exited rank, a collective mismatch), the launch fails as a ``hang`` at once
    (`megatron_testkit.stall`, `megatron_testkit.wait_graph`). Past 10 s it prints a progress
    line every ``KIT_HEARTBEAT`` seconds (`megatron_testkit.heartbeat`). In a session, the launch first waits until the session's
    admission ledger has room for its ranks' budgets (`megatron_testkit.admission`). Raises
    `RankFailure` when any rank fails, `TypeError` when ``fn`` cannot be imported by name in a
    fresh process, `BudgetBelowFootprint` when the host budget is smaller than an idle rank, and
    `admission.NeverFits` when its ranks' budgets exceed the runner's memory. ``process_group=False``
    leaves the default group to ``fn`` (a torchrun-style test's own ``init_process_group``, with
    ``env`` naming its rendezvous); a group it leaves initialised is destroyed after it.
    """
    __tracebackhide__ = True  # pytest shows the kit's message and the rank's traceback, not this source
    # Checked before anything is made or spawned: a bad argument is the caller's, no rank's.
    check_world_size(world_size)
    timeout = default_timeout() if timeout is None else check_timeout(timeout)
    if in_torchrun():
        from megatron_testkit.torchrun import run_in_torchrun

        return run_in_torchrun(
            fn, world_size, backend=backend, args=args, timeout=timeout, stall_window=stall_window
        )
    every = heartbeat.interval()  # KIT_HEARTBEAT, checked before anything is made
    launch = _Launch(
        fn,
        world_size,
        backend=backend,
        timeout=timeout,
        args=args,
        env=env,
        budget=budget,
        stall_window=stall_window,
    )
    launch.process_group = process_group
    return _run(launch, every)


def _run(launch: _Launch, every: float | None) -> list[Any]:
    """Admit, spawn and supervise the launch under its heartbeat, read what the ranks left, ask for
    the verdict, clean up and report; the ranks' results, or the verdict raised."""
    __tracebackhide__ = True
    failure: BaseException | None = None
    name = launch.test_id.rsplit("::", 1)[-1] if launch.in_test else launch.test_id
    beat = heartbeat.Heartbeat(name, launch.world_size, launch.progress, every, launch.queued_so_far).start()
    try:
        launch.start()
        try:
            hung = launch.supervise()
        except BaseException as exc:
            launch.interrupted(exc)
            raise
        records = [r.record(launch.run_dir) for r in launch.ranks]
        launch.name_runner_ooms(records)
        try:
            failure = launch.diagnose(records, hung)
        except BudgetBelowFootprint as exc:
            failure = exc
        results: list[Any] = []
        if failure is None:
            read = launch.results(records)
            failure, results = (read, []) if isinstance(read, RankFailure) else (None, read)
    finally:
        beat.stop()
        leaked = launch.close()
    launch.report(records, failure, leaked)
    if failure is not None:
        raise failure
    return results
