"""Who created the pytest process' CUDA context, for the session header.

A CUDA context costs the pytest process hundreds of MiB of host memory and a slice of the GPU. A
test whose own code uses CUDA creates it knowingly; one created elsewhere (reading a rank's CUDA
tensors, a plugin or conftest at collection) surprises whoever reads the session's memory figures,
so the header says where it came from. Torch is never imported here: no torch, no context.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

# Where a context was first seen: inside a test (setup, call or teardown), inside the kit while it
# read a test's rank results, or before any test ran (collection, a plugin, conftest).
TEST, KIT, OUTSIDE = "test", "kit", "outside"


@dataclass(frozen=True)
class Origin:
    """The first place the pytest process was seen holding a CUDA context."""

    where: str  # TEST, KIT or OUTSIDE
    nodeid: str | None = None  # the test it was seen in (None for OUTSIDE)


_origin: Origin | None = None


def initialized() -> bool:
    """Whether this process holds a CUDA context (torch's lazy init ran); never imports torch."""
    torch = sys.modules.get("torch")
    try:
        return torch is not None and bool(torch.cuda.is_initialized())
    except Exception:  # torch half-imported or broken: it made no context the kit can see
        return False


def current_test() -> str | None:
    """The node id of the test pytest is running (``PYTEST_CURRENT_TEST``), or None."""
    current = os.environ.get("PYTEST_CURRENT_TEST")
    return current.rsplit(" (", 1)[0] if current else None


def observe(where: str, nodeid: str | None = None) -> None:
    """Record ``where`` as the origin if a context exists now and none was seen before.

    Called at the edges of each region (before a test: OUTSIDE; after it: TEST; before the kit
    reads results: TEST; after: KIT), so the first region that ends with a context made it.
    """
    global _origin
    if _origin is None and initialized():
        _origin = Origin(where, nodeid)


def origin() -> Origin | None:
    """Where this process' CUDA context was first seen (None: none seen yet)."""
    return _origin


def header_note(seen: Origin | None) -> str | None:
    """The session header's ``cuda_context``: None when the process holds no context or a test's
    own code created it; else one line saying who did, and what to do about it."""
    if seen is None or seen.where == TEST:
        return None
    if seen.where == KIT:
        return (
            f"created while reading the rank results of {seen.nodeid}: a rank returned CUDA tensors "
            f"(return .cpu() copies to keep CUDA out of pytest)"
        )
    return "created before any test ran (collection, a plugin or conftest.py imported and used CUDA)"
