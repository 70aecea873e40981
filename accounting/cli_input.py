"""Integer lists for the command line, inline or from `@FILE` / `@-` / `-` (stdin), read within bounds.

A list can be long (one document length per line), so it may come from a file; whatever the
file is, reading stops at `MAX_LIST_BYTES`, and only a regular file or stdin is read (a FIFO or a
device such as /dev/zero is refused up front). An error names the entry's index and where the
list came from, never the text it holds (the file may be anything the user pointed at).
"""

from __future__ import annotations

import argparse
import os
import re
import stat
import sys

# The most text a list may be: ~8 million document lengths, a pack far past what one step holds;
# its int64 tensor is 64 MB.
MAX_LIST_BYTES = 64 * 2**20
# An entry longer than this cannot be an int64 (19 digits and a sign), whatever it holds.
MAX_ENTRY_CHARS = 40
# Python's own integer literal, ASCII digits only: "1_000" reads, "1__0", "0x10", "٣" do not.
_INTEGER = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*")


def _bounded(data: bytes, source: str) -> str:
    if len(data) > MAX_LIST_BYTES:
        raise argparse.ArgumentTypeError(
            f"{source} holds more than {MAX_LIST_BYTES} bytes, the most a list may be"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{source} is not UTF-8 text") from None


def read_source(text: str) -> tuple[str, str]:
    """The list's text and where it came from: inline, `@FILE`, or `-` / `@-` for stdin."""
    if text in ("-", "@-"):
        return _bounded(sys.stdin.buffer.read(MAX_LIST_BYTES + 1), "stdin"), "stdin"
    if not text.startswith("@"):
        return text, "the argument"
    path = text[1:]
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise argparse.ArgumentTypeError(f"{path!r} is not a regular file")
            data = handle.read(MAX_LIST_BYTES + 1)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {err.strerror}") from None
    return _bounded(data, repr(path)), repr(path)


def int_list(text: str) -> list[int]:
    """Integers separated by commas and/or whitespace; `argparse.ArgumentTypeError` names the
    first malformed entry by its index."""
    body, source = read_source(text)
    values = []
    for index, part in enumerate(part for part in re.split(r"[,\s]+", body) if part):
        if len(part) > MAX_ENTRY_CHARS or not _INTEGER.fullmatch(part):
            raise argparse.ArgumentTypeError(
                f"entry {index} in {source} is not an integer: expected comma-separated integers"
            )
        values.append(int(part))
    return values
