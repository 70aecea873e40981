"""Warm starts: ranks forked from a warm parent (`megatron_testkit.warm_parent`) instead of spawned.

Each process that launches ranks owns at most one warm parent per interpreter and preload set,
started at its first launch as its child, and ended with it (a lifeline pipe on the parent's stdin,
and ``PR_SET_PDEATHSIG``). A launch goes warm only when nothing speaks against it; otherwise it
starts cold (spawned, as before) and says why (`cold_reason`, `env_refusal`, the parent's own
refusal before each fork). The launcher sees a forked rank through `ForkedRank`, which answers as
much of ``subprocess.Popen`` as the launcher uses; its exit status comes from the parent, which
reaped it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WARM_ENV = "KIT_WARM_START"  # 0: every launch starts cold
PRELOAD_ENV = "KIT_WARM_PRELOAD"  # modules the warm parent imports besides torch, comma-separated
BASE_PRELOAD = ("torch", "torch.distributed")
# How long the first launch waits for its warm parent to import its preload set.
_START_TIMEOUT_S = 180.0
_MAX_MESSAGE = 1 << 16

# Variables a launch may set or change and still fork from the warm parent: read after the fork
# (by the rank's own set-up, the process group, NCCL, the CUDA driver at its first use), or the
# parent's own thread settings, which the rank sets again after the fork. Any other difference
# between the rank's environment and the parent's could have been read at import: cold.
ALLOWED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
        "PYTHONUNBUFFERED",
        "PYTHONFAULTHANDLER",
        "PYTEST_CURRENT_TEST",
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
        "PYTEST_XDIST_TESTRUNUID",
        # torch sets it in its own process the first time it computes its compile cache's folder
        # (importing megatron-core does), and reads it at each use, never at import.
        "TORCHINDUCTOR_CACHE_DIR",
        # megatron-core's LanguageModule sets these in its own process whenever it builds a model
        # (its attention backend), so a session that builds one in-process changed them for every
        # later launch; Transformer Engine reads them when it picks a backend for each attention
        # call, never at import.
        "NVTE_FLASH_ATTN",
        "NVTE_FUSED_ATTN",
        "NVTE_UNFUSED_ATTN",
    }
)
ALLOWED_ENV_PREFIXES = ("KIT_", "TORCH_NCCL_", "NCCL_")
# Set in the warm parent before torch loads: numpy's OpenBLAS starts a thread pool at import
# otherwise, and a process with threads must not fork.
PARENT_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}

INDUCTOR_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"

# Room in the parent's environment area for each forked rank's own variables, which it writes
# there in place so that `/proc/<rank>/environ` reads as a spawned rank's (`warm_parent.take_identity`).
ROOM_ENV = "KIT_WARM_ROOM"
_ROOM_BYTES = 16384

_ini_preload: tuple[str, ...] = ()
_lock = threading.Lock()
_parents: dict[tuple[str, tuple[str, ...]], WarmParent] = {}
_reported: set[str] = set()  # preload failures already warned about in this process


class WarmPreloadWarning(UserWarning):
    """A module of the warm preload set failed to import (the parent serves without it)."""


def set_ini_preload(modules: list[str]) -> None:
    """The project's ``kit_warm_preload`` ini lines (set by the plugin)."""
    global _ini_preload
    _ini_preload = tuple(m.strip() for m in modules if m.strip())


def preload_set(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """torch, torch.distributed, then the ini's modules and ``KIT_WARM_PRELOAD``'s, in order, once each."""
    environ = os.environ if environ is None else environ
    extra = [m.strip() for m in environ.get(PRELOAD_ENV, "").split(",") if m.strip()]
    out: list[str] = []
    for name in (*BASE_PRELOAD, *_ini_preload, *extra):
        if name not in out:
            out.append(name)
    return tuple(out)


_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_settings(environ: Mapping[str, str] | None = None) -> None:
    """ValueError naming the variable for a ``KIT_WARM_START`` other than 0 or 1, or a
    ``KIT_WARM_PRELOAD`` entry that is not a module name."""
    environ = os.environ if environ is None else environ
    raw = environ.get(WARM_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{WARM_ENV}={raw!r}: expected 0 (warm starts off) or 1")
    for name in environ.get(PRELOAD_ENV, "").split(","):
        if name.strip() and not _MODULE_NAME.match(name.strip()):
            raise ValueError(
                f"{PRELOAD_ENV}: {name.strip()!r} is not a module name (comma-separated, e.g. numpy,mylib.ops)"
            )


def cold_reason(*, fresh_interpreter: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """Why a launch must start cold whatever its environment; None when it may go warm."""
    environ = os.environ if environ is None else environ
    if environ.get(WARM_ENV, "1").strip() == "0":
        return f"{WARM_ENV}=0"
    if fresh_interpreter:
        return "the test is marked fresh_interpreter"
    if not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return "warm starts need Linux"
    if environ.get("KIT_RANK_CGROUP"):
        return (
            "KIT_RANK_CGROUP: pages a forked rank shares with its parent stay charged to the parent's cgroup"
        )
    return None


def env_refusal(rank_env: Mapping[str, str], parent_env: Mapping[str, str]) -> str | None:
    """The variables the rank's environment sets, changes or drops that a preloaded module may
    have read at import (not in `ALLOWED_ENV`); None when there are none."""
    keys = sorted(
        key
        for key in set(rank_env) | set(parent_env)
        if rank_env.get(key) != parent_env.get(key)
        and key not in ALLOWED_ENV
        and not key.startswith(ALLOWED_ENV_PREFIXES)
    )
    if not keys:
        return None
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return f"the ranks' environment differs from the warm parent's in {shown} (a preloaded module may read it at import)"


class ForkedRank:
    """A rank forked by the warm parent, as the launcher sees it: ``pid``, ``returncode``, ``poll``,
    ``wait``, ``send_signal``, ``kill``. The parent reaps it and sends its exit status over the
    connection, which is also the rank's lifeline: closed, the parent kills the rank."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.returncode: int | None = None
        self.orphans: list[int] = []  # re-parented to the warm parent when this rank died

    def _read(self, timeout: float = 0.0) -> None:
        while True:
            try:
                ready, _, _ = select.select([self.sock], [], [], timeout)
            except (OSError, ValueError):
                ready = []
            if not ready:
                return
            timeout = 0.0
            try:
                data = self.sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:  # the parent died: its ranks died with it (PR_SET_PDEATHSIG)
                if self.returncode is None:
                    self.returncode = -signal.SIGKILL
                self.sock.close()
                return
            with contextlib.suppress(ValueError):
                message = json.loads(data)
                if isinstance(message.get("exit"), int):
                    self.returncode = message["exit"]
                if isinstance(message.get("orphan"), int):
                    self.orphans.append(message["orphan"])

    def poll(self) -> int | None:
        if self.returncode is None and self.sock.fileno() >= 0:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.1 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(f"forked rank {self.pid}", timeout or 0.0)
            if self.sock.fileno() >= 0:
                self._read(min(left, 0.1))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def adopted(self) -> list[int]:
        """Orphans of this rank that the parent handed over (read what arrived first)."""
        if self.sock.fileno() >= 0:
            self._read()
        return list(self.orphans)

    def release(self) -> None:
        """Close the connection: a rank still running is killed by the parent."""
        if self.sock.fileno() >= 0:
            self._read()
            self.sock.close()


class WarmRefused(Exception):
    """The warm parent would not fork (why: the message); the launch starts cold."""


@dataclass
class WarmParent:
    """One warm parent as its owner sees it: the process, its socket, what it preloaded."""

    proc: subprocess.Popen | None  # None: another process' (the xdist controller's, `warm_broker`)
    folder: str
    socket_path: str
    preload: tuple[str, ...]
    env: dict[str, str]
    preloaded: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    refusal: str | None = None
    remote_pid: int | None = None
    # Modules whose import made forking unsafe (a thread, CUDA), while it is: the owner rebuilds
    # the parent without them at the first launch this parent refuses.
    unsafe: dict[str, str] = field(default_factory=dict)
    # Its memory in the admission ledgers (the session's, the machine's): released when it stops.
    charges: list[tuple[Any, Any]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else int(self.remote_pid or 0)

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return os.path.exists(self.socket_path) and psutil_alive(self.pid)

    def describe(self) -> dict[str, object]:
        """What a worker needs to use this parent (`warm_broker` sends it)."""
        return {
            "socket": self.socket_path,
            "pid": self.pid,
            "preload": list(self.preload),
            "env": self.env,
            "preloaded": self.preloaded,
            "failed": self.failed,
            "refusal": self.refusal,
            "unsafe": self.unsafe,
        }

    def note(self) -> str | None:
        """What the report says about this parent on a warm launch: the preloads that failed."""
        if not self.failed:
            return None
        return "preload failed: " + "; ".join(f"{k} ({v})" for k, v in self.failed.items())

    def fork(self, env: Mapping[str, str], log_fd: int, spec: str, tag: str) -> ForkedRank:
        """Ask for one rank; `WarmRefused` when the parent refuses or cannot be reached."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(self.socket_path)
            request = {"op": "fork", "env": dict(env), "cwd": os.getcwd(), "spec": spec, "tag": tag}
            socket.send_fds(sock, [json.dumps(request).encode()], [log_fd])
            ready, _, _ = select.select([sock], [], [], 30.0)
            data = sock.recv(_MAX_MESSAGE) if ready else b""
        except OSError as exc:
            sock.close()
            raise WarmRefused(f"the warm parent could not be reached: {exc}") from None
        try:
            reply = json.loads(data) if data else {}
        except ValueError:
            reply = {}
        if isinstance(reply.get("pid"), int):
            return ForkedRank(sock, reply["pid"])
        sock.close()
        raise WarmRefused(str(reply.get("cold") or reply.get("error") or "the warm parent did not answer"))

    def stop(self) -> None:
        """Close the lifeline: the parent kills its ranks and exits (only its owner can); its memory
        leaves the admission ledgers."""
        if self.proc is None:
            return
        for ledger, ticket in self.charges:
            if ledger.path.exists():  # else gone with its session: nothing to release
                with contextlib.suppress(Exception):
                    ledger.release(ticket)
        self.charges = []
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def psutil_alive(pid: int) -> bool:
    """Whether ``pid`` runs (and is no zombie)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def parent_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the warm parent starts with: the owner's, without the session's ledger
    (ranks never join it), with one thread per library."""
    env = dict(os.environ if environ is None else environ)
    env.pop("KIT_ADMISSION_DIR", None)
    env.update(PARENT_ENV)
    # As every rank's environment has it (`ranks._rank_env`): Inductor reads it when
    # torch._inductor.config is imported, which the megatron-core parent does before any fork.
    env.setdefault(INDUCTOR_THREADS_ENV, "1")
    env[ROOM_ENV] = "x" * _ROOM_BYTES
    return env


def _start(preload: tuple[str, ...], environ: Mapping[str, str] | None = None) -> WarmParent:
    folder = tempfile.mkdtemp(prefix="kit-warm-")
    socket_path = os.path.join(folder, "parent.sock")
    config = {
        "owner": os.getpid(),
        "socket": socket_path,
        "preload": list(preload),
        "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
    }
    env = parent_environment(environ)
    log = open(os.path.join(folder, "parent.log"), "wb")  # noqa: SIM115 (the parent writes it)
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from megatron_testkit.warm_parent import serve; serve(sys.argv[1])",
                json.dumps(config),
                "kit-warm-parent",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            start_new_session=True,
        )
    finally:
        log.close()
    parent = WarmParent(proc, folder, socket_path, preload, env)
    _exempt(proc.pid)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], _START_TIMEOUT_S)
    line = proc.stdout.readline() if ready else b""
    try:
        hello = json.loads(line) if line else None
    except ValueError:
        hello = None
    if not isinstance(hello, dict):
        parent.stop()
        tail = _log_tail(Path(folder, "parent.log"))
        raise WarmRefused(f"the warm parent did not start: {tail.strip().splitlines()[-1:] or 'no output'}")
    parent.preloaded = list(hello.get("preloaded") or [])
    parent.failed = {str(k): str(v) for k, v in (hello.get("failed") or {}).items()}
    parent.unsafe = {str(k): str(v) for k, v in (hello.get("unsafe") or {}).items()}
    parent.refusal = hello.get("refusal")
    if parent.refusal and parent.unsafe:
        blamed = "; ".join(f"{k} {v}" for k, v in parent.unsafe.items())
        parent.refusal = f"{parent.refusal}: {blamed}; the warm parent is rebuilt without it"
    parent.charges = _charge_ledgers(proc.pid, preload)
    return parent


def _charge_ledgers(pid: int, preload: tuple[str, ...]) -> list[tuple[Any, Any]]:
    """Count the warm parent's resident memory, once, in the admission ledgers of this process'
    session (and the machine's, for a top-level session): it runs already, so it is recorded at
    once, never queued; launches after it wait for room instead. Its entries name the parent, so
    they leave the ledgers when it stops or dies."""
    from megatron_testkit import admission, machine_ledger, procfs

    size = procfs.rss_bytes(pid)
    if not size:
        return []
    label = f"the warm parent (pid {pid}) of {', '.join(preload)}"
    charges: list[tuple[Any, Any]] = []
    with contextlib.suppress(ValueError):  # a malformed KIT_ADMISSION: the session refused it already
        for ledger in (admission.session_ledger(), machine_ledger.launch_ledger()):
            if ledger is not None:
                with contextlib.suppress(OSError, ValueError):  # unwritable: the launches go on
                    charges.append((ledger, ledger.charge(pid, size, label)))
    return charges


class WarmStarting(Exception):
    """The warm parent is still importing its preload set (asked with ``wait=False``)."""


STARTING = "the warm parent is still starting (importing its preload set)"
BROKER_MAX_MESSAGE = 1 << 20
BROKER_ASK_TIMEOUT_S = 240.0  # the controller may be importing torch into the parent meanwhile


def _log_tail(path: Path, size: int = 600) -> str:
    """The last `size` bytes of the parent's log (it may have grown large: never read whole)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read(size).decode(errors="replace")
    except OSError:
        return ""


def ask_broker(path: str, preload: tuple[str, ...]) -> WarmParent | None:
    """A worker's side of `megatron_testkit.warm_broker`: the controller's warm parent for ``preload``: `WarmStarting` while the controller
    starts it, `WarmRefused` when it could not; None when the broker cannot be reached
    (the worker then starts its own)."""
    request = {"preload": list(preload), "env": dict(os.environ)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(BROKER_ASK_TIMEOUT_S)
            sock.connect(path)
            sock.send(json.dumps(request).encode())
            reply = json.loads(sock.recv(BROKER_MAX_MESSAGE) or b"{}")
    except (OSError, ValueError):
        return None
    if not isinstance(reply, dict):
        return None
    if reply.get("starting"):
        raise WarmStarting(str(reply["starting"]))
    if reply.get("error"):
        raise WarmRefused(str(reply["error"]))
    try:
        return WarmParent(
            proc=None,
            folder=os.path.dirname(str(reply["socket"])),
            socket_path=str(reply["socket"]),
            preload=tuple(reply["preload"]),
            env={str(k): str(v) for k, v in reply["env"].items()},
            preloaded=list(reply["preloaded"]),
            failed={str(k): str(v) for k, v in reply["failed"].items()},
            refusal=reply.get("refusal"),
            remote_pid=int(reply["pid"]),
            unsafe={str(k): str(v) for k, v in (reply.get("unsafe") or {}).items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def parent_for(
    preload: tuple[str, ...], environ: Mapping[str, str] | None = None, *, wait: bool = True
) -> WarmParent:
    """The warm parent for ``preload``: the xdist controller's when this is a worker (asked through
    its broker, `megatron_testkit.warm_broker`), else this process' own (``environ``: the
    environment it starts with, default this process'). One that is missing or died is started in
    the background; ``wait=False`` then raises `WarmStarting` at once, ``wait=True`` waits for it
    (a launch does: `plan`). `WarmRefused` when it cannot start.

    A parent that a preloaded module made unsafe to fork from (`WarmParent.unsafe`) is rebuilt
    without that module when a launch first asks for it; until the new one is up, launches get
    the old one, whose refusal says why they start cold, and ``wait=True`` waits for the new one."""
    key = (sys.executable, preload)
    deadline = time.monotonic() + _START_TIMEOUT_S + 30
    while True:
        done: threading.Event | None = None
        with _lock:
            parent = _parents.get(key)
            if parent is not None and not parent.alive():
                parent.stop()
                _unexempt(parent.pid)
                del _parents[key]
                parent = None
            if parent is None and key in _failed:
                raise WarmRefused(_failed[key])
            controller_starting = False
            if parent is None and _broker_path is not None:
                try:
                    parent = ask_broker(_broker_path, preload)  # None: start one of our own
                except WarmStarting:
                    controller_starting = True
                if parent is not None:
                    _parents[key] = parent
            rebuilding = _starting.get(key)
            if parent is not None and parent.unsafe and parent.proc is not None:
                if rebuilding is None and not wait and key not in _failed:  # a failed rebuild: once
                    _drop(parent.unsafe)
                    _starting[key] = threading.Event()
                    _start_in_background(key, _without_dropped(preload), parent.env, _starting[key])
                elif rebuilding is not None and wait:
                    parent, done = None, rebuilding
            elif parent is None and not controller_starting:
                done = rebuilding
                if done is None:
                    done = _starting[key] = threading.Event()
                    _start_in_background(key, _without_dropped(preload), environ, done)
        if parent is not None:
            _report_failed_preloads(parent)
            return parent
        if not wait or time.monotonic() > deadline:
            raise WarmStarting(STARTING) if not wait else WarmRefused("the warm parent did not start in time")
        if done is not None:
            done.wait(max(0.0, deadline - time.monotonic()))
        else:
            time.sleep(0.2)


_dropped: dict[str, str] = {}  # module -> why it was dropped from every preload set of this process
_dropped_lines: list[str] = []  # the same, once each, in order (the session header's slice of it)


def _drop(unsafe: Mapping[str, str]) -> None:
    """Drop these modules from this process' preload sets from now on (called with `_lock` held)."""
    for name, why in unsafe.items():
        if name not in _dropped:
            _dropped[name] = why
            harm = "a fork copies no thread but its locks" if "thread" in why else "no fork may inherit CUDA"
            _dropped_lines.append(
                f"{name} was dropped from the warm preload set: it {why} ({harm}); "
                "the warm parent was rebuilt without it"
            )


def _without_dropped(preload: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in preload if name not in _dropped)


def dropped_mark() -> int:
    """Where this process' record of dropped preloads stands now (a session's start)."""
    return len(_dropped_lines)


def dropped_since(mark: int) -> list[str]:
    """One line per module dropped from the preload set since ``mark`` (`dropped_mark`)."""
    return list(_dropped_lines[mark:])


_starting: dict[tuple[str, tuple[str, ...]], threading.Event] = {}
_failed: dict[tuple[str, tuple[str, ...]], str] = {}
_jobs: queue.Queue = queue.Queue()
_keeper: threading.Thread | None = None


def _start_in_background(
    key: tuple[str, tuple[str, ...]],
    preload: tuple[str, ...],
    environ: Mapping[str, str] | None,
    done: threading.Event,
) -> None:
    """Have the keeper thread start the parent (called with `_lock` held). One thread that lives
    as long as this process starts every parent: a parent dies with the thread that started it
    (PR_SET_PDEATHSIG), so a launch from a short-lived thread must not start it."""
    global _keeper
    if _keeper is None or not _keeper.is_alive():
        _keeper = threading.Thread(target=_keep, name="kit-warm-parent-keeper", daemon=True)
        _keeper.start()
    _jobs.put((key, preload, None if environ is None else dict(environ), done))


def _keep() -> None:
    while True:
        key, preload, environ, done = _jobs.get()
        try:
            parent = _start(preload, environ)
            with _lock:
                old = _parents.get(key)
                _parents[key] = parent
            if old is not None and old is not parent:  # a rebuild: the unsafe parent ends now
                old.stop()
                _unexempt(old.pid)
        except BaseException as exc:  # whatever it was, the launches start cold and say why
            with _lock:
                _failed[key] = (
                    str(exc) if isinstance(exc, WarmRefused) else f"the warm parent did not start: {exc}"
                )
        finally:
            with _lock:
                _starting.pop(key, None)
            done.set()


def _report_failed_preloads(parent: WarmParent) -> None:
    """Warn once per module and process about a preload that failed (never skipped silently)."""
    for name, why in parent.failed.items():
        if name not in _reported:
            _reported.add(name)
            warnings.warn(
                WarmPreloadWarning(
                    f"warm start: preloading {name} failed ({why}); the warm parent serves without it"
                ),
                stacklevel=3,
            )


_broker_path: str | None = None


def settings() -> tuple[tuple[str, ...], str | None]:
    """This process' warm-start settings (ini preloads, broker), for `restore_settings`."""
    return _ini_preload, _broker_path


def restore_settings(saved: tuple[tuple[str, ...], str | None]) -> None:
    """Put back what `settings` returned (after an in-process pytest session ends)."""
    global _ini_preload, _broker_path
    _ini_preload, _broker_path = saved


def set_broker(path: str | None) -> None:
    """Use the xdist controller's warm parents (its broker's socket), not parents of this process."""
    global _broker_path
    _broker_path = path


def parent_pids() -> set[int]:
    """The pids of this process' warm parents (exempt from the leak guard, never adopted orphans)."""
    return {p.pid for p in _parents.values()}


def _exempt(pid: int) -> None:
    from megatron_testkit import proctree

    proctree.EXEMPT_PIDS.add(pid)


def _unexempt(pid: int) -> None:
    from megatron_testkit import proctree

    proctree.EXEMPT_PIDS.discard(pid)


@atexit.register
def stop_all() -> None:
    """End every warm parent of this process (also done by their lifelines when it dies)."""
    with _lock:
        for key, parent in list(_parents.items()):
            with contextlib.suppress(Exception):
                parent.stop()
            _unexempt(parent.pid)
            del _parents[key]
        _parents.clear()


@dataclass
class StartPlan:
    """How a launch starts: the warm parent to fork from (None: cold) and why (cold, or a warm note)."""

    parent: WarmParent | None
    reason: str | None

    @property
    def mode(self) -> str:
        return "warm" if self.parent is not None else "cold"


# An import of megatron (or of a module named after it: `fixtures.megatron`, the kit's
# `megatron_testkit.megatron_cpu`): anywhere in the function itself, or at its module's top level.
_IMPORT = r"(?:from|import)[ \t]+(?:[\w.]*\bmegatron\b|megatron_testkit\.megatron_)"
_MEGATRON_IMPORT = re.compile(r"^[ \t]*" + _IMPORT, re.MULTILINE)
_MEGATRON_TOP_LEVEL_IMPORT = re.compile(r"^" + _IMPORT, re.MULTILINE)
MEGATRON_PRELOAD = "megatron.core"


def imports_megatron(fn: Callable[..., object] | None) -> bool:
    """Whether ``fn`` imports megatron itself or its module does at its top level (read from the
    source, the module's first MiB). A function that reaches megatron only through another of its
    module's functions is not seen: its ranks then import megatron-core after the fork."""
    import inspect

    with contextlib.suppress(OSError, TypeError):
        if _MEGATRON_IMPORT.search(inspect.getsource(fn)[: 1 << 20]):  # type: ignore[arg-type]
            return True
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if not path or not str(path).endswith(".py"):
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return _MEGATRON_TOP_LEVEL_IMPORT.search(f.read(1 << 20)) is not None
    except OSError:
        return False


def plan(
    rank_env: Mapping[str, str], *, fresh_interpreter: bool, fn: Callable[..., object] | None = None
) -> StartPlan:
    """Warm when nothing speaks against it, else cold with the reason. A function whose module
    imports megatron forks from a parent that preloaded megatron-core too (a parent of its own:
    megatron-core's import changes torch for every rank forked from it)."""
    reason = cold_reason(fresh_interpreter=fresh_interpreter)
    if reason is not None:
        return StartPlan(None, reason)
    preload = preload_set()
    if MEGATRON_PRELOAD not in preload and imports_megatron(fn):
        preload = (*preload, MEGATRON_PRELOAD)
    try:
        try:
            # Asked without waiting first: that is what starts the rebuild of an unsafe parent (this
            # launch then goes cold with its refusal), where ``wait=True`` would wait for the rebuild.
            parent = parent_for(preload, wait=False)
        except WarmStarting:
            # A cold start would import the same modules in every rank, beside the parent's own
            # import: on a busy machine that is (ranks + 1) imports for one launch. Waiting for the
            # parent costs no more wall time than its import, which each cold rank pays too.
            parent = parent_for(preload, wait=True)
    except WarmRefused as exc:
        return StartPlan(None, str(exc))
    reason = env_refusal(rank_env, parent.env)
    if reason is not None:
        return StartPlan(None, reason)
    if parent.refusal:
        return StartPlan(None, parent.refusal)
    if not parent.preloaded:
        return StartPlan(None, parent.note() or "the warm parent preloaded nothing")
    return StartPlan(parent, parent.note())
