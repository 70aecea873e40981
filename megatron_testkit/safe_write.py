"""The one writer of every file the kit writes: contained in an allowed folder, never through a link, atomic.

Golden files and candidates (a test's ``golden/`` folder), reports and merged reports (the report
folder) and rank logs (the session's log folder) are written through a `Folder`:

- the allowed folder is resolved once, when the `Folder` is made: links in the path above it are
  the user's own (a checkout under a linked home, macOS's ``/var``) and they work;
- below it nothing is followed: every component is opened from its parent's descriptor with
  ``O_NOFOLLOW``, and a link inside the folder, dangling or not, is refused with its name; a
  relative path with ``..``, an absolute path or an empty component is refused before anything
  is opened;
- a file is written atomically: a temporary file in the same folder, fsync, then rename over the
  old one (and the folder fsynced), so a full disk leaves the previous file or none, never a torn
  one, and says so in one line (`WriteRefused`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from accounting.json_input import printable

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class WriteRefused(OSError):
    """A write the kit refused or could not make (a link, an escape, a full disk); one line."""


def check_relative(relative: str | os.PathLike[str], what: str = "path") -> tuple[str, ...]:
    """The components of a relative path that stays inside its folder; `WriteRefused` for an
    absolute path, ``..``, ``.``, an empty component or a NUL byte, naming `what`."""
    text = os.fspath(relative)
    shown = printable(text, 200)
    if not text or "\0" in text:
        raise WriteRefused(f"{what} {shown!r} is empty or holds a NUL byte")
    path = PurePosixPath(text)
    if path.is_absolute() or text.startswith("/"):
        raise WriteRefused(f"{what} {shown!r} is an absolute path: it must stay inside its folder")
    parts = text.split("/")
    for part in parts:
        if part in ("", ".", ".."):
            raise WriteRefused(
                f"{what} {shown!r} has a {part or 'empty'!r} component: it must stay inside its folder"
            )
    return tuple(parts)


class Folder:
    """An allowed folder, resolved once; everything written below it is contained and atomic."""

    def __init__(self, root: str | os.PathLike[str], *, create: bool = True, what: str = "folder") -> None:
        self.path = Path(os.path.realpath(root))  # once: links above the folder are the user's own
        try:
            if create:
                self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, _DIR_FLAGS)
        except OSError as exc:
            raise WriteRefused(
                f"{what} {printable(str(root), 300)}: cannot use it as a folder ({_reason(exc)})"
            ) from None
        os.close(fd)

    def __repr__(self) -> str:
        return f"Folder({str(self.path)!r})"

    @contextlib.contextmanager
    def _parent(self, parts: tuple[str, ...], create: bool) -> Iterator[int]:
        """A descriptor of the folder holding ``parts[-1]``, each component opened without following links."""
        fd = os.open(self.path, _DIR_FLAGS)
        try:
            for i, part in enumerate(parts[:-1]):
                where = self.path.joinpath(*parts[: i + 1])
                made: OSError | None = None
                if create:
                    try:
                        os.mkdir(part, 0o777, dir_fd=fd)
                    except FileExistsError:
                        pass
                    except OSError as exc:  # read-only, no space: said below if the folder is missing
                        made = exc
                try:
                    child = os.open(part, _DIR_FLAGS | _NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                        raise WriteRefused(
                            f"{printable(str(where), 300)} is a link: the kit never writes through one"
                        ) from None
                    reason = _reason(made if made is not None and exc.errno == errno.ENOENT else exc)
                    raise WriteRefused(
                        f"cannot make the folder {printable(str(where), 300)} ({reason})"
                    ) from None
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def write_bytes(self, relative: str | os.PathLike[str], data: bytes) -> Path:
        """Write `data` to `relative` atomically (temporary file, fsync, rename); the path written."""
        parts = check_relative(relative)
        path = self.path.joinpath(*parts)
        shown = printable(str(path), 300)
        with self._parent(parts, create=True) as parent:
            name = parts[-1]
            _refuse_link_or_special(name, parent, shown)
            tmp = f".{name[:80]}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                    0o666,
                    dir_fd=parent,
                )
            except OSError as exc:
                raise WriteRefused(f"cannot write {shown}: {_reason(exc)}") from None
            try:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.rename(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=parent)
                raise WriteRefused(
                    f"cannot write {shown}: {_reason(exc)} (nothing written: the previous file, if any, is unchanged)"
                ) from None
            with contextlib.suppress(OSError):
                os.fsync(parent)  # the rename itself survives a crash
        return path

    def write_text(self, relative: str | os.PathLike[str], text: str) -> Path:
        """`write_bytes` of `text` as UTF-8."""
        return self.write_bytes(relative, text.encode("utf-8"))

    def open_new(self, relative: str | os.PathLike[str]) -> IO[bytes]:
        """A new file at `relative` opened for writing (a stream: a rank's log); refused when
        anything, a link included, is already there. Not atomic: a stream is written as it runs."""
        parts = check_relative(relative)
        path = self.path.joinpath(*parts)
        with self._parent(parts, create=True) as parent:
            try:
                fd = os.open(
                    parts[-1],
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                    0o666,
                    dir_fd=parent,
                )
            except FileExistsError:
                raise WriteRefused(
                    f"{printable(str(path), 300)} already exists: the kit makes a new file there"
                ) from None
            except OSError as exc:
                raise WriteRefused(f"cannot write {printable(str(path), 300)}: {_reason(exc)}") from None
        return os.fdopen(fd, "wb")

    def lstat(self, relative: str | os.PathLike[str]) -> os.stat_result | None:
        """What is at `relative` without following a link there (None when nothing is)."""
        parts = check_relative(relative)
        with self._parent(parts, create=False) as parent:
            try:
                return os.lstat(parts[-1], dir_fd=parent)
            except FileNotFoundError:
                return None

    def rename(self, relative: str | os.PathLike[str], new_name: str) -> Path:
        """Rename the entry at `relative` to `new_name` in the same folder (a link is renamed, not
        followed); refused when `new_name` exists. The new path."""
        parts = check_relative(relative)
        (name,) = check_relative(new_name)
        with self._parent(parts, create=False) as parent:
            if self.lstat_in(parent, name) is not None:
                raise WriteRefused(
                    f"{printable(str(self.path.joinpath(*parts[:-1], name)), 300)} already exists"
                )
            try:
                os.rename(parts[-1], name, src_dir_fd=parent, dst_dir_fd=parent)
            except OSError as exc:
                raise WriteRefused(
                    f"cannot rename {printable(str(self.path.joinpath(*parts)), 300)}: {_reason(exc)}"
                ) from None
        return self.path.joinpath(*parts[:-1], name)

    def remove(self, relative: str | os.PathLike[str]) -> bool:
        """Remove the file (or link, never followed) at `relative`; False when nothing was there."""
        parts = check_relative(relative)
        with self._parent(parts, create=False) as parent:
            try:
                os.unlink(parts[-1], dir_fd=parent)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise WriteRefused(
                    f"cannot remove {printable(str(self.path.joinpath(*parts)), 300)}: {_reason(exc)}"
                ) from None
        return True

    @staticmethod
    def lstat_in(parent: int, name: str) -> os.stat_result | None:
        try:
            return os.lstat(name, dir_fd=parent)
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def lock(self, name: str, timeout_s: float = 120.0) -> Iterator[None]:
        """Hold an exclusive ``flock`` on the file `name` in the folder (made when missing, never
        through a link) for the block; waits up to `timeout_s` for another holder, then refuses."""
        (name,) = check_relative(name)
        where = printable(str(self.path / name), 300)
        fd_dir = os.open(self.path, _DIR_FLAGS)
        try:
            try:
                fd = os.open(
                    name,
                    os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                    0o666,
                    dir_fd=fd_dir,
                )
            except OSError as exc:
                if _is_link(name, fd_dir):
                    raise WriteRefused(f"{where} is a link: the kit never writes through one") from None
                raise WriteRefused(f"cannot lock {where}: {_reason(exc)}") from None
        finally:
            os.close(fd_dir)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise WriteRefused(
                            f"{where} stayed locked by another session for {timeout_s:g} s"
                        ) from None
                    time.sleep(0.05)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def make_dir(self, relative: str | os.PathLike[str]) -> Path:
        """Make the folder `relative` (and its parents) without following a link; the path."""
        parts = check_relative(relative)
        with self._parent((*parts, "."), create=True):
            pass
        return self.path.joinpath(*parts)

    def make_unique_dir(self, relative: str | os.PathLike[str]) -> Path:
        """A new folder at `relative`, or ``<name>.2``, ``<name>.3``... when it exists (two launches
        of one test never share one); made atomically, without following a link."""
        parts = check_relative(relative)
        with self._parent(parts, create=True) as parent:
            name, n = parts[-1], 1
            while True:
                candidate = name if n == 1 else f"{name}.{n}"
                try:
                    os.mkdir(candidate, 0o777, dir_fd=parent)
                    return self.path.joinpath(*parts[:-1], candidate)
                except FileExistsError:
                    n += 1
                except OSError as exc:
                    where = printable(str(self.path.joinpath(*parts[:-1], candidate)), 300)
                    raise WriteRefused(f"cannot make the folder {where}: {_reason(exc)}") from None


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def _refuse_link_or_special(name: str, dir_fd: int, shown: str) -> None:
    """Refuse a link (dangling or not) or a non-regular file where a file is about to be written."""
    try:
        mode = os.lstat(name, dir_fd=dir_fd).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise WriteRefused(f"{shown} is a link: the kit never writes through one")
    if not stat.S_ISREG(mode):
        raise WriteRefused(f"{shown} exists and is not a regular file")


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{exc.strerror} (the disk or the file-size limit is full)"
    return exc.strerror or str(exc)
