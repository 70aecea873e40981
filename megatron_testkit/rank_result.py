"""A rank's return value, pickled so that reading it imports nothing the reader lacks.

A tensor pickles its storage as a call to ``torch.storage._load_from_bytes``, looked up when the
storage is pickled. megatron-core (0.19) replaces that attribute when it is imported, so a rank
that imported it pickled every tensor as a call to ``megatron.core.safe_globals``, and unpickling
the result in pytest imported megatron-core there (and Transformer Engine on a GPU machine):
hundreds of MiB the session's memory check counted. torch's own loader is kept here before
anything replaces it, and results are pickled with it.
"""

from __future__ import annotations

import pickle
import sys
import threading
from typing import IO, Any

_lock = threading.Lock()
_torch_loader: Any = None  # torch's own ``torch.storage._load_from_bytes``, once kept


def _is_torch_loader(fn: Any) -> bool:
    """Whether ``fn`` is torch's own storage loader (not a replacement a library put there)."""
    return getattr(fn, "__module__", None) == "torch.storage" and getattr(fn, "__qualname__", None) == (
        "_load_from_bytes"
    )


def keep_torch_storage_loader() -> bool:
    """Keep torch's own ``torch.storage._load_from_bytes`` (imports torch); call it before any
    library that replaces it is imported. True when it is kept (now or before), False when a
    replacement was already in place (results are then pickled as that replacement makes them)."""
    global _torch_loader
    import torch.storage

    with _lock:
        if _torch_loader is None and _is_torch_loader(torch.storage._load_from_bytes):
            _torch_loader = torch.storage._load_from_bytes
        return _torch_loader is not None


def dump_result(result: Any, file: IO[bytes]) -> None:
    """Pickle ``result`` into ``file`` with torch's own storage loader in place, whatever a library
    swapped in since `keep_torch_storage_loader`; the swapped-in loader is put back afterwards."""
    storage = sys.modules.get("torch.storage")
    if storage is None or _torch_loader is None:  # no torch, or no loader kept: nothing to restore
        pickle.dump(result, file)
        return
    with _lock:
        # The storages look the loader up in their module when pickled (their ``__reduce__``),
        # and pickle checks that the module attribute is the function it names.
        swapped = storage._load_from_bytes
        storage._load_from_bytes = _torch_loader
        try:
            pickle.dump(result, file)
        finally:
            storage._load_from_bytes = swapped
