"""`run_ranks`: run a function on N fresh ranks with a process group, and name the rank that failed.

Each call spawns ``world_size`` fresh Python processes (never forks the test process), each in
its own session so that its whole process tree can be killed. They rendezvous through a
FileStore in the launch's directory, so parallel pytest workers never compete for a port. The
parent polls them; the first failure tears the others down, and `megatron_testkit.diagnosis` turns what
they left behind into a `RankFailure` that leads with the root cause.

Under ``torchrun`` (RANK and WORLD_SIZE set by an elastic agent) nothing is spawned: the
function runs in this process on this rank, so the same tests run as multi-node jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

from megatron_testkit import attribution, proctree
from megatron_testkit.attribution import RunSummary
from megatron_testkit.budgets import MemoryBudget
from megatron_testkit.diagnosis import RankRecord, format_failure, root_cause, signal_name

DEFAULT_TIMEOUT = float(os.environ.get("KIT_RANK_TIMEOUT", "300"))
# After the first failure, how long the other ranks get to fail on their own (their knock-on
# errors are evidence) before the launcher dumps their stacks and kills them.
_GRACE_S = 1.0
_POLL_S = 0.05
_LOG_TAIL_LINES = 40

_BOOTSTRAP = (
    "import json, os, sys\n"
    "spec = json.load(open(os.environ['KIT_RANK_SPEC']))\n"
    "sys.path[:] = spec['sys_path'] + [p for p in sys.path if p not in spec['sys_path']]\n"
    "from megatron_testkit.rank_worker import main\n"
    "main()\n"
)


class RankFailure(Exception):
    """A launch failed. ``rank`` is the root cause, ``kind`` one of oom, error, crash, hang.

    ``records`` holds a `RankRecord` for every rank; ``log_dir`` the directory with the rank
    logs, records and stack dumps. ``str()`` leads with ``rank <r> <kind>: ...``.
    """

    def __init__(
        self, message: str, *, rank: int, kind: str, records: list[RankRecord], log_dir: str | None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.records = records
        self.log_dir = log_dir

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: the default exception pickling would lose them.
        return (_rebuild_failure, (str(self), self.rank, self.kind, self.records, self.log_dir))


def _rebuild_failure(
    message: str, rank: int, kind: str, records: list[RankRecord], log_dir: str | None
) -> RankFailure:
    return RankFailure(message, rank=rank, kind=kind, records=records, log_dir=log_dir)


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


def choose_backend(backend: str, world_size: int) -> str:
    """``auto`` -> nccl when there are at least ``world_size`` GPUs, else gloo."""
    if backend != "auto":
        return backend
    return "nccl" if cuda_device_count() >= world_size else "gloo"


def _check_picklable(fn: Callable[..., Any], args: Sequence[Any]) -> bytes:
    qualname = getattr(fn, "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(
            f"run_ranks needs a module-level function (ranks are spawned and import it by name), "
            f"got {module}.{qualname}: move it to the top level of its module"
        )
    if module == "__main__":
        main_spec = getattr(sys.modules["__main__"], "__spec__", None)
        if main_spec is None or not main_spec.name:
            raise TypeError(
                f"run_ranks cannot import {qualname} from a script run as __main__: put it in an "
                f"importable module or run the script with `python -m`"
            )
    try:
        return pickle.dumps((fn, tuple(args)))
    except Exception as exc:
        raise TypeError(
            f"run_ranks cannot send {module}.{qualname} and its args to the ranks "
            f"(spawned processes import the function by name and unpickle the args): {exc}"
        ) from exc


def _main_module_name() -> str:
    """The importable name of a ``python -m`` script, whose functions pickle as ``__main__.x``."""
    return sys.modules["__main__"].__spec__.name


def _threads_per_rank(world_size: int) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Also share the cores with the other xdist workers: oversubscription, not compute, is
    # what made 2-rank CPU runs several times slower in the measurements.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, cores // (world_size * max(1, workers)))


def _run_dir(test_id: str | None, log_root: str | None) -> tuple[Path, bool]:
    """The launch's directory, and whether it is kept (True under --kit-report)."""
    if log_root:
        base = Path(log_root) / attribution.sanitise(test_id or "outside-pytest")
        base.parent.mkdir(parents=True, exist_ok=True)
        path, n = base, 1
        while True:
            try:
                path.mkdir()  # atomic: two launches of one test id never share a directory
                return path, True
            except FileExistsError:
                n += 1
                path = base.with_name(f"{base.name}.{n}")
    scratch = attribution.scratch_root()
    if scratch:
        Path(scratch).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="kit-ranks-", dir=scratch)), False


def _rank_env(
    env: dict[str, str] | None, rank: int, world_size: int, spec_path: Path, threads: int, seed: int
) -> dict:
    child = dict(os.environ)
    for key in ("PYTEST_XDIST_WORKER", "TORCHELASTIC_RUN_ID", "LOCAL_RANK", "GROUP_RANK"):
        child.pop(key, None)
    child.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "KIT_RANK_SPEC": str(spec_path),
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "PYTHONFAULTHANDLER": "1",
            # The launch's seed; rank r seeds random, numpy and torch with KIT_TEST_SEED + r.
            "KIT_TEST_SEED": str(seed),
        }
    )
    if env:
        child.update({k: str(v) for k, v in env.items()})
    return child


def _nccl_env(run_dir: Path) -> dict[str, str]:
    """Flight recorder on, dumped into the launch's directory when a collective times out."""
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(run_dir / "nccl_flight_recorder_rank"),
        # Older torch reads only this name for the same dump.
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(run_dir / "nccl_flight_recorder_rank"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def _read_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _read_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _collect(
    run_dir: Path,
    procs: list[subprocess.Popen],
    exit_times: list[float | None],
    statuses: list[str],
    sampled_peak: list[int | None],
) -> list[RankRecord]:
    records = []
    for rank, proc in enumerate(procs):
        rec = RankRecord(rank=rank, status=statuses[rank], pid=proc.pid)
        rec.exit_code = proc.returncode if proc.returncode is not None and proc.returncode >= 0 else None
        rec.signal = signal_name(proc.returncode)
        rec.time = exit_times[rank]
        rec.log_path = str(run_dir / f"rank{rank}.log")
        rec.peak_host_bytes = sampled_peak[rank]
        path = run_dir / f"rank{rank}.json"
        if path.exists():
            data = json.loads(path.read_text())
            for key in ("exc_type", "exc_message", "traceback", "kind_hint", "last_collective"):
                setattr(rec, key, data.get(key))
            rec.collective_seq = data.get("collective_seq") or 0
            rec.time = data.get("time", rec.time)
            rec.peak_host_bytes = data.get("peak_host_bytes") or rec.peak_host_bytes
            rec.peak_device_bytes = data.get("peak_device_bytes")
            if data.get("status") == "failed" and rec.status in ("ok", "torn_down", "hung"):
                rec.status = "failed"
        else:
            with contextlib.suppress(OSError, ValueError):
                state = json.loads((run_dir / f"rank{rank}.state").read_text().strip() or "{}")
                rec.last_collective = state.get("last_collective")
                rec.collective_seq = state.get("seq") or 0
        with contextlib.suppress(OSError):
            rec.stack = (run_dir / f"rank{rank}.stacks").read_text().strip() or None
        if rec.status != "ok":
            # A rank killed without a record (NCCL's watchdog aborts with SIGABRT) is diagnosed
            # from what it printed last.
            rec.log_tail = _read_tail(Path(rec.log_path))
        records.append(rec)
    return records


def _rank_rows(records: list[RankRecord]) -> list[dict[str, Any]]:
    return [
        {
            "rank": r.rank,
            "peak_host_bytes": r.peak_host_bytes,
            "peak_device_bytes": r.peak_device_bytes,
            "exit_code": r.exit_code,
            "signal": r.signal,
        }
        for r in records
    ]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    args: Sequence[Any] = (),
    env: dict[str, str] | None = None,
    budget: MemoryBudget | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh ranks; return their results.

    The default process group is initialised before ``fn`` and destroyed after it. ``backend``
    is ``auto`` (NCCL with at least ``world_size`` GPUs, else gloo), ``gloo`` or ``nccl``.
    ``timeout`` (seconds, from spawn) bounds the whole launch; past it every rank's Python stack
    is dumped and the launch fails as a hang. ``env`` adds environment variables for the ranks.
    ``budget`` overrides the test's ``memory_budget`` marker. Raises `RankFailure` when any rank
    fails, `TypeError` when ``fn`` cannot be imported by name in a fresh process.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if in_torchrun():
        from megatron_testkit.torchrun import run_in_torchrun

        return run_in_torchrun(fn, world_size, backend=backend, args=args)
    payload = _check_picklable(fn, args)
    context = attribution.current()
    test_id = attribution.current_test_id() or f"{getattr(fn, '__module__', '?')}.{fn.__qualname__}"
    if budget is None and context is not None:
        budget = context.budget
    budget = budget or MemoryBudget()
    chosen = choose_backend(backend, world_size)
    seed = attribution.seed_for(test_id)
    run_dir, keep = _run_dir(test_id, context.log_root if context else attribution.log_root())
    threads = _threads_per_rank(world_size)
    # The process group times out before the launch does, so NCCL's watchdog writes its flight
    # recorder while the launcher still waits; gloo gets the same margin.
    pg_timeout = max(5.0, min(timeout * 0.8, timeout - 10.0))
    (run_dir / "payload.pkl").write_bytes(payload)
    spec = {
        "world_size": world_size,
        "backend": chosen,
        "run_dir": str(run_dir),
        "store": str(run_dir / "filestore"),
        "payload": str(run_dir / "payload.pkl"),
        "pg_timeout_s": pg_timeout,
        "seed": seed,
        "threads": threads,
        "budget_host_bytes": budget.host_bytes,
        "budget_device_bytes": budget.device_bytes,
        "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
        "track_collectives": os.environ.get("KIT_TRACK_COLLECTIVES", "1") != "0",
        "main_module": _main_module_name() if getattr(fn, "__module__", None) == "__main__" else None,
    }
    package_root = str(Path(__file__).resolve().parent.parent)
    if package_root not in spec["sys_path"]:
        spec["sys_path"].append(package_root)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    extra_env = dict(_nccl_env(run_dir)) if chosen == "nccl" else {}
    extra_env.update(env or {})

    started = time.time()
    procs: list[subprocess.Popen] = []
    logs = []
    helpers: dict[int, psutil.Process] = {}
    statuses = ["running"] * world_size
    exit_times: list[float | None] = [None] * world_size
    sampled_peak: list[int | None] = [None] * world_size
    failure: RankFailure | None = None
    results: list[Any] = []
    leaked = 0
    try:
        for rank in range(world_size):
            log = open(run_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    # The trailing argument names the rank in `ps` output.
                    [sys.executable, "-c", _BOOTSTRAP, f"kit-rank-{rank}-of-{world_size}"],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=_rank_env(extra_env, rank, world_size, spec_path, threads, seed),
                    start_new_session=True,
                )
            )
        try:
            hung = _supervise(procs, statuses, exit_times, sampled_peak, helpers, timeout)
        except BaseException as exc:
            # Interrupted from outside (Ctrl-C, pytest-timeout's signal method): still show
            # where every rank was before they are killed in `finally`.
            _interrupted(exc, procs, statuses, run_dir)
            raise
        for log in logs:
            log.close()
        records = _collect(run_dir, procs, exit_times, statuses, sampled_peak)
        root = root_cause(records)
        if root is None and not hung:
            for rank in range(world_size):
                with open(run_dir / f"rank{rank}.result", "rb") as f:
                    results.append(pickle.load(f))
        else:
            assert root is not None
            for rec in records:
                rec.log_tail = rec.log_tail or _read_tail(Path(rec.log_path))
            message = format_failure(
                root,
                records,
                timeout=timeout,
                log_dir=str(run_dir),
                started=started,
            )
            if attribution.current_test_id():
                # Same test id, same seeds: this replays the launch as it ran.
                message += (
                    f"\nrepro: KIT_SEED={seed} python -m pytest '{test_id}' "
                    f"(world_size={world_size}, backend={chosen})"
                )
            failure = RankFailure(
                message, rank=root.rank, kind=root.kind or "error", records=records, log_dir=str(run_dir)
            )
    finally:
        for log in logs:
            log.close()
        leaked = proctree.kill_tree([p.pid for p in procs], list(helpers.values()))
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
    records_for_report = (
        failure.records if failure else _collect(run_dir, procs, exit_times, statuses, sampled_peak)
    )
    attribution.record_run(
        RunSummary(
            world_size=world_size,
            backend=chosen,
            started=started,
            seed=seed,
            duration_s=time.time() - started,
            log_dir=str(run_dir) if keep or failure else None,
            ranks=_rank_rows(records_for_report),
            failure=(
                {
                    "rank": failure.rank,
                    "kind": failure.kind,
                    "first_line": str(failure).splitlines()[0],
                    "message": str(failure),
                }
                if failure
                else None
            ),
            leaked_processes=leaked,
        )
    )
    if not keep and failure is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        # Kept for people and CI artifacts: logs, records, stacks; not the pickled payload and
        # results, which can be large.
        for path in [run_dir / "payload.pkl", *run_dir.glob("rank*.result")]:
            path.unlink(missing_ok=True)
    if failure is not None:
        raise failure
    return results


def _supervise(
    procs: list[subprocess.Popen],
    statuses: list[str],
    exit_times: list[float | None],
    sampled_peak: list[int | None],
    helpers: dict[int, psutil.Process],
    timeout: float,
) -> bool:
    """Poll the ranks until all exit, one fails (plus a grace), or the timeout; True on a hang."""
    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    last_scan = 0.0
    while True:
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if statuses[rank] != "running":
                continue
            peak = _read_hwm(proc.pid)
            if peak is not None:
                sampled_peak[rank] = max(peak, sampled_peak[rank] or 0)
            rc = proc.poll()
            if rc is None:
                continue
            exit_times[rank] = time.time()
            statuses[rank] = "ok" if rc == 0 else "failed"
            if rc != 0 and first_failure is None:
                first_failure = now
        if now - last_scan > 0.5:
            # Remember helpers that might leave the rank's process group before it dies.
            last_scan = now
            for proc in procs:
                for child in proctree.descendants(proc.pid):
                    helpers.setdefault(child.pid, child)
        running = [r for r in range(len(procs)) if statuses[r] == "running"]
        if not running:
            return False
        if first_failure is not None and now - first_failure > _GRACE_S:
            _dump_and_stop(procs, running, statuses, "torn_down")
            return False
        if now > deadline:
            _dump_and_stop(procs, running, statuses, "hung")
            return True
        time.sleep(_POLL_S)


def _interrupted(
    exc: BaseException, procs: list[subprocess.Popen], statuses: list[str], run_dir: Path
) -> None:
    running = [r for r in range(len(procs)) if statuses[r] == "running"]
    with contextlib.suppress(BaseException):
        _dump_and_stop(procs, running, statuses, "torn_down")
        stacks = []
        for rank in running:
            with contextlib.suppress(OSError):
                text = (run_dir / f"rank{rank}.stacks").read_text().strip()
                stacks.append(f"rank {rank}:\n{text}")
        if stacks and hasattr(exc, "add_note"):
            exc.add_note(f"run_ranks was interrupted; rank logs in {run_dir}; stacks:\n" + "\n".join(stacks))


def _dump_and_stop(procs: list[subprocess.Popen], ranks: list[int], statuses: list[str], status: str) -> None:
    """Ask the given ranks for a faulthandler stack dump, then kill their process groups."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.5)
    for rank in ranks:
        proctree.signal_group(procs[rank].pid, signal.SIGKILL)
        statuses[rank] = status
    for rank in ranks:
        with contextlib.suppress(Exception):
            procs[rank].wait(timeout=5)
