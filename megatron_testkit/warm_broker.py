"""One warm parent per session under xdist: the controller starts it, its workers fork from it.

The controller (`megatron_testkit.plugin`) serves a Unix socket from a thread of its own (`Broker`);
a worker's first launch asks it for the warm parent of its preload set (`warm_start.ask_broker`), the controller
starts it as its own child if it has none (`warm_start.parent_for`), and answers with its socket,
pid and environment. The worker then connects to the parent directly for each rank, so the rank's
lifeline is the worker's connection: a worker that dies takes its ranks with it, and the parent
lives as long as the controller. Any failure to reach the broker leaves the worker to start a
parent of its own, as a lone session does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import threading

from megatron_testkit import warm_start

_MAX_MESSAGE = warm_start.BROKER_MAX_MESSAGE


class Broker:
    """The controller's side: a socket and the thread that answers workers' requests."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="kit-warm-broker-")
        self.path = os.path.join(self.folder, "broker.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(self.path)
        self.listener.listen(16)
        # The parents are started from this thread, so it lives as long as the process: a
        # parent asked to die with the thread that started it (PR_SET_PDEATHSIG).
        self.thread = threading.Thread(target=self._serve, name="kit-warm-broker", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                conn.send(json.dumps(self._answer(json.loads(conn.recv(_MAX_MESSAGE)))).encode())

    @staticmethod
    def _answer(request: dict[str, object]) -> dict[str, object]:
        preload = tuple(str(m) for m in request["preload"])  # type: ignore[union-attr]
        env = {str(k): str(v) for k, v in request["env"].items()}  # type: ignore[union-attr]
        try:
            return warm_start.parent_for(preload, env, wait=False).describe()
        except warm_start.WarmStarting as exc:
            return {"starting": str(exc)}
        except warm_start.WarmRefused as exc:
            return {"error": str(exc)}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)
