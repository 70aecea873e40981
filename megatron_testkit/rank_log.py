"""A rank's log, capped: the head as it comes, the tail in a ring buffer, and a line saying how much was cut.

A rank's stdout and stderr go to a pipe that a thread of the launcher drains into ``rank<N>.log``.
The first half of the cap (``KIT_RANK_LOG_BYTES``, default `DEFAULT_CAP`) is written as it comes,
so a person can follow the log while the rank runs; after that only the newest half is kept, in
memory, and written at the end after a line that says how many bytes were cut. A rank that floods
its output (1 GiB of stdout) costs the cap, on disk and in memory, not the flood. The diagnosis
reads a rank's last lines from here (`tail_text`), so a failure's message shows what the rank
printed last even when the log was cut.
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import threading
from typing import IO

from megatron_testkit.budgets import format_size, parse_size

CAP_ENV = "KIT_RANK_LOG_BYTES"
# 8 MiB a rank: megatron's own logging over a functional test is well under 1 MiB, and a CI
# artifact of a few ranks' logs stays small.
DEFAULT_CAP = 8 * 2**20
# Below this a log could not hold one traceback.
MIN_CAP = 64 * 2**10
_CHUNK = 1 << 16
_RECENT = 64 * 2**10


def log_cap(environ: dict[str, str] | None = None) -> int:
    """``KIT_RANK_LOG_BYTES`` (a size: ``8MiB``, ``1GB``...), else `DEFAULT_CAP`; ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(CAP_ENV, "").strip()
    if not raw:
        return DEFAULT_CAP
    try:
        cap = parse_size(raw)
    except ValueError:
        cap = None
    if cap is None or cap < MIN_CAP:
        raise ValueError(f"{CAP_ENV}={raw!r}: expected a size of at least {format_size(MIN_CAP)}, e.g. 8MiB")
    return cap


class CappedLog:
    """One rank's output: a pipe whose read end a thread drains into `file`, within `cap` bytes."""

    def __init__(self, file: IO[bytes], cap: int, rank: int) -> None:
        self.file, self.cap, self.rank = file, cap, rank
        self.head_left = cap // 2
        self.tail_cap = cap - cap // 2
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_bytes = 0
        self.received = 0
        self.head_end = b""  # the head's last `_RECENT` bytes, for `tail_text` while nothing is cut
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.lock = threading.Lock()
        self.eof = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._drain, name=f"kit-rank{rank}-log", daemon=True)

    def started(self) -> None:
        """The rank holds the write end now: close ours (EOF comes when the rank's tree closes it) and drain."""
        os.close(self.write_fd)
        self.write_fd = -1
        self.thread.start()

    def _drain(self) -> None:
        while not self.stopping.is_set() and not self.eof:
            try:
                ready, _, _ = select.select([self.read_fd], [], [], 0.1)
            except (OSError, ValueError):
                return
            if ready:
                self.drain_now()

    def drain_now(self) -> None:
        """Take what the pipe holds now, without waiting (the caller's thread or the drain's)."""
        with self.lock:
            while not self.eof:
                try:
                    data = os.read(self.read_fd, _CHUNK)
                except BlockingIOError:
                    return
                except OSError:
                    self.eof = True
                    return
                if not data:
                    self.eof = True
                    return
                self._take(data)

    def _take(self, data: bytes) -> None:
        self.received += len(data)
        if self.head_left:
            head, data = data[: self.head_left], data[self.head_left :]
            self.head_left -= len(head)
            self.head_end = (self.head_end + head)[-_RECENT:]
            with contextlib.suppress(OSError, ValueError):  # a full disk: the tail still comes
                self.file.write(head)
                self.file.flush()
        if not data:
            return
        self.tail.append(data)
        self.tail_bytes += len(data)
        while self.tail and self.tail_bytes - len(self.tail[0]) >= self.tail_cap:
            self.tail_bytes -= len(self.tail.popleft())

    @property
    def cut(self) -> int:
        """Bytes of output neither in the head nor in the tail kept."""
        return max(0, self.received - (self.cap // 2 - self.head_left) - min(self.tail_bytes, self.tail_cap))

    def _kept_tail(self) -> bytes:
        data = b"".join(self.tail)
        return data[-self.tail_cap :] if len(data) > self.tail_cap else data

    def tail_text(self, limit: int = _RECENT) -> str:
        """The last `limit` bytes (at most `_RECENT`) of the rank's output as text (for the failure message)."""
        self.drain_now()
        with self.lock:
            tail = self._kept_tail()
            if len(tail) < limit and not self.cut:
                tail = self.head_end + tail
        return tail[-limit:].decode(errors="replace")

    def close(self) -> None:
        """Stop draining, write the cut line and the kept tail, close the file and the pipe."""
        self.stopping.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.drain_now()
        with self.lock:
            with contextlib.suppress(OSError, ValueError):
                if self.cut:
                    kept_head = self.cap // 2 - self.head_left
                    self.file.write(
                        f"\n[kit: {self.cut} bytes of rank {self.rank}'s output cut here: the first "
                        f"{kept_head} and the last {len(self._kept_tail())} bytes are kept "
                        f"({CAP_ENV}={self.cap})]\n".encode()
                    )
                self.file.write(self._kept_tail())
            with contextlib.suppress(OSError, ValueError):
                self.file.close()
            for fd in (self.read_fd, self.write_fd):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.read_fd = self.write_fd = -1
            self.eof = True
