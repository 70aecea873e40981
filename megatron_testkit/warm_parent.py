"""The warm parent: a process that imported torch (and a preload set) once and forks ranks on request.

Started by `megatron_testkit.warm_start` as a child of the session's process. It imports its
preload set, says which modules failed and which made forking unsafe (its owner then rebuilds it
without them), then serves one Unix-socket connection per rank: a request
carries the rank's environment, working directory and log descriptor (``SCM_RIGHTS``); the parent
checks that forking is safe (one OS thread, CUDA not initialised, the driver included), forks, and
relays the rank's pid, then its exit status. The forked rank starts a new session, dies with the
parent (``PR_SET_PDEATHSIG``), and imports the test's module only after the fork
(`megatron_testkit.rank_worker`). A closed connection is the launcher's death or its end: a rank
still running then is killed with its process group. The parent is a subreaper: orphans of a dead
rank re-parent here and are handed to the launch, whose leak guard kills and counts them. EOF on
stdin (the owner's lifeline pipe) or the owner's death ends the parent and every rank it forked.

Single-threaded on purpose: a fork copies one thread, and a lock held by another would stay held.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
# Exit code of a forked rank whose parent died before it could ask to die with it.
ORPHAN_EXIT = 87
_MAX_MESSAGE = 1 << 20
# What every rank imports before the test's module (`megatron_testkit.rank_worker`'s set-up).
_KIT_MODULES = (
    "megatron_testkit.rank_worker",
    "megatron_testkit.collectives",
    "megatron_testkit.golden",
    "numpy",
)
_SCAN_S = 0.1  # how often new orphans are looked for
# cuDeviceGetCount's answer when cuInit was never called: the driver is loaded but not initialised.
_CUDA_ERROR_NOT_INITIALIZED = 3


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def thread_count() -> int:
    """This process' OS threads (``/proc/self/task``), the kernel's count, not Python's."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def cuda_state() -> str | None:
    """Why CUDA makes a fork unsafe here (torch's context, or a driver some import initialised);
    None when it does not."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    with contextlib.suppress(Exception):
        if cuda is not None and cuda.is_initialized():
            return "torch initialised CUDA in the warm parent"
    try:
        with open("/proc/self/maps") as f:
            loaded = "libcuda.so" in f.read()
    except OSError:
        return None
    if not loaded:
        return None
    # The driver is mapped: a call before cuInit answers NOT_INITIALIZED and changes nothing.
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        status = driver.cuDeviceGetCount(ctypes.byref(count))
    except (OSError, AttributeError) as exc:
        return f"the CUDA driver is loaded in the warm parent and could not be asked whether it is initialised: {exc}"
    if status == _CUDA_ERROR_NOT_INITIALIZED:
        return None
    return "the CUDA driver was initialised (cuInit) in the warm parent by a preloaded module"


def fork_refusal() -> str | None:
    """Why forking now would be unsafe; None when it is safe."""
    threads = thread_count()
    if threads != 1:
        return f"the warm parent runs {threads} OS threads (a preloaded module started one); a fork would copy their locks"
    return cuda_state()


def preload(modules: list[str]) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Import each module; the imported ones, per failed one why (never skipped silently), and per
    module whose import made forking unsafe (started an OS thread, initialised CUDA) what it did.

    torch's own storage loader is kept as soon as torch is in, before any other preload (megatron-core
    replaces it), so that every forked rank pickles tensor results with it.
    """
    done: list[str] = []
    failed: dict[str, str] = {}
    unsafe: dict[str, str] = {}
    for name in modules:
        threads, cuda = thread_count(), cuda_state()
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module's import runs arbitrary code: SystemExit included
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            continue
        done.append(name)
        why = import_effect(threads, cuda)
        if why is not None:
            unsafe[name] = why
        if name == "torch" or (name.startswith("torch.") and "torch" in sys.modules):
            from megatron_testkit import rank_result

            rank_result.keep_torch_storage_loader()
    return done, failed, unsafe


def import_effect(threads_before: int, cuda_before: str | None) -> str | None:
    """What an import just did that makes forking unsafe, compared with the state before it: the
    OS threads it started, or CUDA it initialised; None when it did neither."""
    started = thread_count() - threads_before
    if started > 0:
        return f"started {started} OS thread{'s' if started > 1 else ''} at import"
    cuda = cuda_state()
    if cuda is not None and cuda_before is None:
        return f"initialised CUDA at import ({cuda})"
    return None


class _Connection:
    """One launcher's request for one rank, and that rank once forked."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid: int | None = None
        self.spec: str | None = None
        self.exited = False
        self.closed = False

    def send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.sock.send(json.dumps(message).encode())


class WarmParent:
    """The serving loop: accept, fork, reap, relay, hand orphans over, die with the owner."""

    def __init__(self, listener: socket.socket, lifeline: int) -> None:
        self.listener = listener
        self.lifeline = lifeline
        self.connections: list[_Connection] = []
        self.by_pid: dict[int, _Connection] = {}
        self.orphans: set[int] = set()  # handed to a launch already (or reaped)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.last_exit: _Connection | None = None

    def serve(self) -> None:
        last_scan = 0.0
        while True:
            watched = [self.listener, self.lifeline, self.wake_r] + [c.sock for c in self.connections]
            try:
                ready, _, _ = select.select(watched, [], [], _SCAN_S)
            except InterruptedError:
                ready = []
            if self.lifeline in ready and not os.read(self.lifeline, 4096):
                self.shutdown()
                return
            if self.wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self.wake_r, 4096)
            if self.listener in ready:
                with contextlib.suppress(OSError):
                    sock, _ = self.listener.accept()
                    self.connections.append(_Connection(sock))
            for conn in [c for c in self.connections if c.sock in ready]:
                self.handle(conn)
            self.reap()
            now = time.monotonic()
            if now - last_scan > _SCAN_S:
                last_scan = now
                self.hand_over_orphans()

    def handle(self, conn: _Connection) -> None:
        try:
            data, fds, _flags, _addr = socket.recv_fds(conn.sock, _MAX_MESSAGE, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            self.drop(conn)
            return
        try:
            request = json.loads(data)
            if request.get("op") != "fork" or conn.pid is not None or len(fds) != 1:
                conn.send({"error": "expected one fork request with one log descriptor"})
                return
            reason = fork_refusal()
            if reason is not None:
                conn.send({"cold": reason})
                return
            conn.spec = str(request.get("spec") or "")
            pid = self.fork_rank(request, fds[0], conn)
            conn.pid = pid
            self.by_pid[pid] = conn
            conn.send({"pid": pid})
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def fork_rank(self, request: dict[str, Any], log_fd: int, conn: _Connection) -> int:
        """Fork one rank; return once it has its own session and asked to die with this process."""
        started_r, started_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the rank
            code = 1
            try:
                os.close(started_r)
                self.in_child(conn, log_fd)
                os.setsid()
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != parent:
                    os._exit(ORPHAN_EXIT)
                os.write(started_w, b"1")
                os.close(started_w)
                code = run_rank(request)
            except BaseException:  # the rank's bootstrap failed: say so in its log
                with contextlib.suppress(Exception):
                    os.write(2, traceback.format_exc().encode(errors="replace"))
            finally:
                os._exit(code)
        os.close(started_w)
        with contextlib.suppress(OSError):
            os.read(started_r, 1)  # its session exists: killpg(pid) reaches it from now on
        os.close(started_r)
        return pid

    def in_child(self, conn: _Connection, log_fd: int) -> None:
        """The forked rank lets go of everything that is the parent's (sockets, wake-up, lifeline)."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a spawned interpreter
        for fd in (self.wake_r, self.wake_w, self.lifeline):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.listener.close()
        for other in self.connections:
            other.sock.close()
        null = os.open(os.devnull, os.O_RDONLY)  # fd 0 itself when the lifeline was fd 0
        if null != 0:
            os.dup2(null, 0)
            os.close(null)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)

    def drop(self, conn: _Connection) -> None:
        """The launcher closed the connection (it ended, or died): a rank still running dies with it."""
        if conn.pid is not None and not conn.exited:
            with contextlib.suppress(OSError):
                os.killpg(conn.pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(conn.pid, signal.SIGKILL)
        conn.closed = True
        conn.sock.close()
        self.connections.remove(conn)
        if conn.exited or conn.pid is None:
            self.by_pid.pop(conn.pid or -1, None)

    def reap(self) -> None:
        """Collect every exited child; a rank's status goes to its launcher."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.by_pid.pop(pid, None)
            if conn is None:
                self.orphans.add(pid)
                continue
            conn.exited = True
            self.last_exit = conn
            # The rank's orphans re-parented here as it exited: handed over before its exit status,
            # so the launch has them when it sees the rank gone.
            self.hand_over_orphans()
            if not conn.closed:
                conn.send({"exit": os.waitstatus_to_exitcode(status), "time": time.time()})

    def hand_over_orphans(self) -> None:
        """Children that are not ranks re-parented here when a rank died: each goes to its launch
        (found by its launch marker, else the launch whose rank exited last), which counts it as leaked."""
        children = _children()
        new = [pid for pid in children if pid not in self.by_pid and pid not in self.orphans]
        for pid in new:
            self.orphans.add(pid)
            spec = _launch_marker(pid)
            owner = next((c for c in self.connections if spec and c.spec == spec), None)
            if owner is None and self.last_exit is not None and not self.last_exit.closed:
                owner = self.last_exit
            if owner is None:  # nobody claims it: it is killed here rather than left running
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                continue
            owner.send({"orphan": pid})
        self.orphans = {pid for pid in self.orphans if pid in children}

    def shutdown(self) -> None:
        """The owner is gone or done: every rank still running dies with its process group."""
        for conn in list(self.connections):
            self.drop(conn)
        for pid in _children():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
    return out


def _launch_marker(pid: int) -> str | None:
    prefix = b"KIT_RANK_SPEC="
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read(1 << 20).split(b"\0"):
                if entry.startswith(prefix):
                    return entry[len(prefix) :].decode(errors="replace")
    except OSError:
        return None
    return None


# Fields of /proc/self/stat (1-based) that bound the argument and environment areas.
_ARG_START, _ENV_END = 48, 51
# Written first into a forked rank's environment area, so that they fit whatever else does not:
# what the repro's memory watcher and the leak guard's marker read there.
_FIRST_IN_ENVIRON = ("PYTEST_CURRENT_TEST", "KIT_RANK_SPEC", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def take_identity(tag: str, env: dict[str, str]) -> bool:
    """Make this forked rank's ``/proc`` command line and environment read as a spawned rank's: the
    tag (``kit-rank-R-of-W``) as its last argument and the launch's variables, written in place
    over the parent's (whose areas the forked rank no longer uses: Python holds copies, and glibc's
    ``environ`` points to new strings once ``os.environ`` was replaced). False where it cannot."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(fields[n - 3]) for n in range(_ARG_START, _ENV_END + 1))
    except (OSError, IndexError, ValueError):
        return False
    argv = b"\0".join([os.fsencode(sys.executable), b"-c", b"kit-warm-rank", tag.encode()]) + b"\0"
    order = [k for k in _FIRST_IN_ENVIRON if k in env] + [k for k in env if k not in _FIRST_IN_ENVIRON]
    environ = b""
    for key in order:
        entry = os.fsencode(f"{key}={env[key]}") + b"\0"
        if len(environ) + len(entry) <= env_end - env_start - 1:
            environ += entry
    if len(argv) >= arg_end - arg_start:
        return False
    ctypes.memmove(arg_start, argv.ljust(arg_end - arg_start, b"\0"), arg_end - arg_start)
    ctypes.memmove(env_start, environ.ljust(env_end - env_start, b"\0"), env_end - env_start)
    return True


def run_rank(request: dict[str, Any]) -> int:
    """In the forked rank: take the launch's environment and directory, then run the rank as a
    spawned one would (`rank_worker.main`); the test's module is imported only now."""
    env = {str(k): str(v) for k, v in request["env"].items()}
    tag = str(request.get("tag", "kit-rank"))
    os.environ.clear()
    os.environ.update(env)
    take_identity(tag, env)
    os.chdir(request["cwd"])
    sys.argv = ["-c", tag]
    with open(os.environ["KIT_RANK_SPEC"]) as f:
        spec = json.load(f)
    sys.path[:] = spec["sys_path"] + [p for p in sys.path if p not in spec["sys_path"]]
    from megatron_testkit.rank_worker import main

    main()
    return 0


def serve(config_json: str) -> None:
    """Entry point (``python -c``): ``config_json`` holds the owner's pid, the socket path, the
    preload list and the owner's ``sys.path``. Prints one JSON line: pid, preloaded, failed,
    refusal, and the modules that made forking unsafe (the owner rebuilds the parent without them)."""
    config = json.loads(config_json)
    owner = int(config["owner"])
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != owner:
        os._exit(ORPHAN_EXIT)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the session's to handle
    sys.path[:] = config["sys_path"] + [p for p in sys.path if p not in config["sys_path"]]
    # The ranks' own start-up code, loaded once here too (the kit's, not the preload set: quiet).
    for name in _KIT_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    done, failed, unsafe = preload(list(config["preload"]))
    gc.collect()
    gc.freeze()  # the collector then leaves the preloaded objects' pages shared with the ranks
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(config["socket"])
    listener.listen(64)
    refusal = fork_refusal()
    hello = {
        "pid": os.getpid(),
        "preloaded": done,
        "failed": failed,
        "refusal": refusal,
        # Only while forking is unsafe: a thread that a module started and that ended by now is harmless.
        "unsafe": unsafe if refusal is not None else {},
    }
    sys.stdout.write(json.dumps(hello) + "\n")
    sys.stdout.flush()
    try:
        WarmParent(listener, sys.stdin.fileno()).serve()
    except OSError as exc:
        if exc.errno != errno.EBADF:
            raise
    os._exit(0)
