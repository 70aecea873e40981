"""Which files git tracks, read from the work tree's index file itself: no process is started.

`repro --dry-run` starts no process, yet must refuse the report's ids that the real run refuses
(files git does not track). Both read the tracked files here, so they agree by construction.
The format is git's ``index-format.txt``: versions 2 to 4, SHA-1 or SHA-256 object names. An
index this reader does not know (a split index, a sparse index's folder entries, a repository
set by ``GIT_DIR``) raises `IndexUnknown`; the real run then asks ``git ls-files`` instead.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

from accounting.json_input import JsonInputError, read_regular_file

# An index holds about 100 bytes per file: far more than any project's files.
MAX_INDEX_BYTES = 512 * 2**20
_SMALL_FILE_BYTES = 64 * 2**10  # a `.git` file, `commondir`, the repository's config
_STAT_BYTES = 40  # ctime, mtime, dev, ino, mode, uid, gid, size: ten 32-bit fields
_EXTENDED = 0x4000  # an entry flag: two more flag bytes follow (version 3 and later)
_FOLDER_MODE = 0o040000  # a sparse index's folder entry
# Extensions whose presence means the file alone does not list every tracked path.
_INCOMPLETE = {b"link": "a split index", b"sdir": "a sparse index"}
_GIT_ENVIRONMENT = ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR")


class IndexUnknown(Exception):
    """The work tree's index cannot be read here (the reason in one line): ask git."""


def _small(path: Path) -> str:
    try:
        return read_regular_file(path, _SMALL_FILE_BYTES, "git file").decode("utf-8", "replace")
    except JsonInputError as exc:
        raise IndexUnknown(str(exc)) from None


def find_git_dir(start: Path) -> tuple[Path, Path] | None:
    """(the top of the work tree, its git folder) for the folder `start`; None outside any."""
    for folder in (start, *start.parents):
        dot = folder / ".git"
        if dot.is_dir():
            return folder, dot
        if dot.exists():  # a linked work tree or a submodule: "gitdir: <path>"
            text = _small(dot).strip()
            if not text.startswith("gitdir:"):
                raise IndexUnknown(f"{dot} names no git folder")
            return folder, folder / text.removeprefix("gitdir:").strip()
    return None


def _hash_size(data: bytes, git_dir: Path) -> int:
    """20 (SHA-1) or 32 (SHA-256): from the file's own checksum, else the repository's config."""
    for size, digest in ((20, hashlib.sha1), (32, hashlib.sha256)):
        if len(data) > size and digest(data[:-size]).digest() == data[-size:]:
            return size
    common = git_dir
    if (git_dir / "commondir").is_file():
        common = git_dir / _small(git_dir / "commondir").strip()
    config = _small(common / "config") if (common / "config").is_file() else ""
    return 32 if re.search(r"^\s*objectformat\s*=\s*sha256\s*$", config, re.I | re.M) else 20


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """Git's offset varint (index version 4): its value and the position after it."""
    byte = data[pos]
    pos += 1
    value = byte & 0x7F
    while byte & 0x80:
        byte = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, pos


def parse_index(data: bytes, hash_size: int) -> list[bytes]:
    """The paths of every entry of an index file's bytes (each stage of a conflict once per stage)."""
    if len(data) < 12 + hash_size or data[:4] != b"DIRC":
        raise IndexUnknown("not a git index file")
    version, count = struct.unpack(">II", data[4:12])
    if version not in (2, 3, 4):
        raise IndexUnknown(f"git index version {version}")
    fixed = _STAT_BYTES + hash_size + 2
    pos, previous, paths = 12, b"", []
    try:
        for _ in range(count):
            start = pos
            mode = struct.unpack(">I", data[pos + 24 : pos + 28])[0]
            flags = struct.unpack(">H", data[pos + fixed - 2 : pos + fixed])[0]
            pos += fixed + (2 if flags & _EXTENDED and version >= 3 else 0)
            if version == 4:  # the name is the previous one, less its last `strip` bytes, plus a suffix
                strip, pos = _varint(data, pos)
                end = data.index(b"\0", pos)
                if strip > len(previous):
                    raise IndexUnknown("an entry's name strips more than the name before it")
                name = previous[: len(previous) - strip] + data[pos:end]
                pos = end + 1
            else:  # NUL-terminated, padded with 1 to 8 NUL bytes to a multiple of 8
                end = data.index(b"\0", pos)
                name = data[pos:end]
                pos = start + (end - start + 8) // 8 * 8
            if mode & 0o170000 == _FOLDER_MODE:
                raise IndexUnknown("a sparse index (folder entries)")
            paths.append(name)
            previous = name
        while pos + 8 <= len(data) - hash_size:  # extensions: signature, size, data
            signature, size = data[pos : pos + 4], struct.unpack(">I", data[pos + 4 : pos + 8])[0]
            if signature in _INCOMPLETE:
                raise IndexUnknown(_INCOMPLETE[signature])
            pos += 8 + size
    except (struct.error, ValueError, IndexError):
        raise IndexUnknown("a git index file cut short or malformed") from None
    if pos > len(data) - hash_size:
        raise IndexUnknown("a git index file cut short or malformed")
    return paths


def tracked_files(root: Path) -> set[str] | None:
    """The files git tracks under the folder `root`, as paths relative to it (what ``git ls-files``
    run there lists); None when `root` is in no git work tree. `IndexUnknown` when only git can say."""
    moved = [name for name in _GIT_ENVIRONMENT if os.environ.get(name)]
    if moved:
        raise IndexUnknown(f"{moved[0]} is set")
    root = root.resolve()
    found = find_git_dir(root)
    if found is None:
        return None
    top, git_dir = found
    index = git_dir / "index"
    if not index.exists():
        return set()  # a repository where nothing was added yet
    try:
        data = read_regular_file(index, MAX_INDEX_BYTES, "git index")
    except JsonInputError as exc:
        raise IndexUnknown(str(exc)) from None
    prefix = root.relative_to(top).as_posix()
    prefix = "" if prefix == "." else prefix + "/"
    names = (os.fsdecode(name) for name in parse_index(data, _hash_size(data, git_dir)))
    return {name[len(prefix) :] for name in names if name.startswith(prefix)}
