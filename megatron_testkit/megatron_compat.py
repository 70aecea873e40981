"""megatron-core release differences, detected from what an object has or a function accepts.

The kit supports megatron-core 0.16.1 through 0.19.2 and never reads a version number: each
helper asks the installed release (a signature, a dataclass field, a file in a checkpoint).

- `call_with_supported_kwargs(fn, **kw)`: call with the keywords `fn` accepts;
- `spec_keywords()` / `spec_kwargs()`: the keywords a spec builder really accepts. From
  megatron-core 0.17 `get_gpt_layer_*_spec(*args, **kwargs)` forwards everything to
  `get_gpt_layer_*_submodules`, and the TE one has no `normalization` (0.16 had explicit
  signatures, where an unknown keyword was simply not passed);
- `te_status()` / `gpt_layer_spec()`: Transformer Engine's layer spec when TE imports and a GPU
  exists, else megatron's local spec (with the `core_attention` you pass, if any). TE raises
  `RuntimeError` (not `ImportError`) on a machine without CUDA libraries, so both are caught.
  `te_status()` tries the import in a child interpreter (once per interpreter and TE location),
  never in the calling process: importing TE grows a pytest process by hundreds of MiB;
- `make_packed_seq_params(**fields)`: a THD `PackedSeqParams` with `pad_between_seqs=True`
  (TE's auto-detection compares `cu_seqlens_q_padded[:-1]` with `cu_seqlens_q[:-1]` and reads a
  pack padded after its last document only as unpadded; its CP path then splits real tokens as
  if they were padding). The field exists from megatron-core 0.19; on older releases the flag
  rides on the instance and `te_core_attention()` forwards it to TE;
- `checkpoint_common_state(dir)`: a `dist_checkpointing` checkpoint's common (non-tensor) state,
  from `common.pt` (up to 0.18) or the "common_state" object in the torch_dist files (0.19),
  read with torch alone so that megatron stays out of the calling process.

Importing this module imports neither torch nor megatron.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
from typing import Any

__all__ = [
    "call_with_supported_kwargs",
    "checkpoint_common_state",
    "gpt_layer_spec",
    "make_packed_seq_params",
    "spec_keywords",
    "spec_kwargs",
    "te_core_attention",
    "te_status",
    "with_pad_between_seqs",
]

_TE_IMPORT = "import transformer_engine.pytorch"
_te_import_results: dict[tuple[str, str], tuple[bool, str]] = {}


def _te_imports_in_child(origin: str) -> tuple[bool, str]:
    """Whether `import transformer_engine.pytorch` succeeds in a fresh interpreter (cached).

    Keyed by interpreter and TE location: the answer cannot change within a process unless one
    of them does. The child inherits the environment (CUDA_VISIBLE_DEVICES, PYTHONPATH).
    """
    key = (sys.executable, origin)
    if key not in _te_import_results:
        try:
            child = subprocess.run(
                [sys.executable, "-c", _TE_IMPORT],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        except subprocess.TimeoutExpired:
            result = (False, f"`{_TE_IMPORT}` did not finish within 300 s in a child interpreter")
        else:
            if child.returncode == 0:
                result = (True, "transformer_engine imports and CUDA is available")
            else:
                lines = [line for line in child.stderr.strip().splitlines() if line.strip()]
                last = lines[-1] if lines else f"exit status {child.returncode}"
                result = (False, f"transformer_engine does not import: {last}")
        _te_import_results[key] = result
    return _te_import_results[key]


def te_status() -> tuple[bool, str]:
    """(usable, reason): whether Transformer Engine's spec can be used here, and why not.

    TE needs a GPU; without CUDA libraries `import transformer_engine` raises RuntimeError
    ("cudnn shared object not found"), which megatron's own `except ImportError` misses. The
    import is tried in a child interpreter, so the calling process (pytest's) never loads TE;
    a process that has already imported it (a rank worker) is answered from `sys.modules`.
    """
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device: Transformer Engine needs a GPU"
    if "transformer_engine.pytorch" in sys.modules:
        return True, "transformer_engine is imported and CUDA is available"
    try:
        spec = importlib.util.find_spec("transformer_engine")
    except (ImportError, RuntimeError, OSError, ValueError) as exc:
        return False, f"transformer_engine cannot be located: {type(exc).__name__}: {exc}"
    if spec is None:
        return False, "transformer_engine is not installed"
    return _te_imports_in_child(str(spec.origin or spec.submodule_search_locations))


def call_with_supported_kwargs(fn: Any, **kwargs: Any) -> Any:
    """Call `fn` with the keyword arguments its signature accepts (guards version differences)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def spec_keywords(builder: Any) -> frozenset[str]:
    """The keyword arguments a megatron spec builder really accepts.

    megatron-core 0.16 declares them on `get_gpt_layer_*_spec` itself. From 0.17 the builder is
    `get_gpt_layer_*_spec(*args, **kwargs)` and forwards everything to the
    `get_gpt_layer_*_submodules` function of the same module (gpt_layer_specs.py,
    `get_gpt_layer_with_transformer_engine_spec` in 0.19.2), so its signature says nothing:
    the forwarding target's does. A pure forwarder whose target cannot be found raises, rather
    than let an unknown keyword through.
    """
    params = inspect.signature(builder).parameters.values()
    named = frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        return named
    module = sys.modules.get(builder.__module__)
    target_name = builder.__name__.removesuffix("_spec") + "_submodules"
    target = getattr(module, target_name, None)
    if target is None:
        raise TypeError(
            f"{builder.__module__}.{builder.__name__} takes **kwargs and has no {target_name} to say "
            "which keywords it accepts"
        )
    return named | spec_keywords(target)


def spec_kwargs(builder: Any, **wanted: Any) -> dict[str, Any]:
    """`wanted` restricted to what `builder` accepts (see `spec_keywords`)."""
    accepted = spec_keywords(builder)
    return {k: v for k, v in wanted.items() if k in accepted}


def make_packed_seq_params(**fields: Any) -> Any:
    """A megatron `PackedSeqParams` that tells TE whether there is padding between sequences.

    With padded cumulative lengths and no explicit `pad_between_seqs`, it is set to True.
    TE 2.5-2.13 otherwise infers it as `cu_seqlens_q_padded[:-1] != cu_seqlens_q[:-1]`
    (dot_product_attention.py), so a pack whose only padding follows its last document reads
    as unpadded, and under CP the P2P path then splits `cu_seqlens_q // cp_size` instead of
    each rank's padded offsets (context_parallel.py): real tokens are treated as padding.
    True is always correct when padded lengths are given (equal lengths mean zero padding).

    `PackedSeqParams` has the field from megatron-core 0.19 (TEDotProductAttention forwards
    every field it has); on older releases the flag is set on the instance and
    `te_core_attention()` passes it on. Other unknown fields raise `TypeError` naming them.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    known = {f.name for f in dataclasses.fields(PackedSeqParams)}
    unknown = sorted(set(fields) - known - {"pad_between_seqs"})
    if unknown:
        raise TypeError(f"megatron.core.packed_seq_params.PackedSeqParams has no field(s) {unknown}")
    padded = fields.get("cu_seqlens_q_padded") is not None or fields.get("cu_seqlens_kv_padded") is not None
    pad = fields.pop("pad_between_seqs", True if padded else None)
    if "pad_between_seqs" in known:
        return PackedSeqParams(**fields, pad_between_seqs=pad)
    params = PackedSeqParams(**fields)
    if pad is not None:
        params.pad_between_seqs = pad  # carried to TE by te_core_attention()'s subclass
    return params


def with_pad_between_seqs(attention_cls: type) -> type:
    """`attention_cls` whose forward also hands `packed_seq_params.pad_between_seqs` to TE.

    For megatron-core releases whose `PackedSeqParams` has no `pad_between_seqs` field
    (before 0.19): megatron's `TEDotProductAttention.forward` passes TE exactly the fields named
    in its `kept_packed_seq_params`, read with `getattr` from the params object. The subclass
    adds the name for the duration of one call, only when the params object carries the flag
    (`make_packed_seq_params` sets it), and takes it out again, so other params objects pass
    through unchanged.
    """
    forward_sig = inspect.signature(attention_cls.forward)

    class PadBetweenSeqs(attention_cls):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if not isinstance(getattr(self, "kept_packed_seq_params", None), set):
                raise TypeError(
                    f"{attention_cls.__qualname__} has no kept_packed_seq_params set: "
                    "cannot forward pad_between_seqs to Transformer Engine"
                )

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            bound = forward_sig.bind_partial(self, *args, **kwargs)
            params = bound.arguments.get("packed_seq_params")
            kept = self.kept_packed_seq_params
            add = getattr(params, "pad_between_seqs", None) is not None and "pad_between_seqs" not in kept
            if add:
                kept.add("pad_between_seqs")
            try:
                return super().forward(*args, **kwargs)
            finally:
                if add:
                    kept.discard("pad_between_seqs")

    PadBetweenSeqs.__name__ = PadBetweenSeqs.__qualname__ = f"{attention_cls.__name__}WithPadBetweenSeqs"
    return PadBetweenSeqs


def te_core_attention() -> type:
    """megatron's `TEDotProductAttention`, wrapped by `with_pad_between_seqs` where needed.

    Needed where `PackedSeqParams` lacks the field (megatron-core < 0.19) and TE's
    `DotProductAttention.forward` accepts `pad_between_seqs` (TE >= 2.2); elsewhere the class
    is returned as it is.
    """
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams

    if "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        return TEDotProductAttention
    import transformer_engine.pytorch as te

    if "pad_between_seqs" not in inspect.signature(te.DotProductAttention.forward).parameters:
        return TEDotProductAttention
    return with_pad_between_seqs(TEDotProductAttention)


def gpt_layer_spec(
    use_te: bool | None = None, *, normalization: str = "RMSNorm", core_attention: type | None = None
) -> Any:
    """The GPT layer `ModuleSpec` for this machine.

    `use_te=None` picks TE when `te_status()` allows it; `use_te=True` raises with the reason when
    it does not. Keywords go only where the builder accepts them (`spec_kwargs`): the TE spec
    takes its norm from `TransformerConfig.normalization`, the local one from the keyword. The
    TE spec gets `te_core_attention()` (pad_between_seqs on every release); the local spec keeps
    megatron's own core attention unless `core_attention` names a replacement (for packed THD
    and context parallelism without TE, which megatron's local attention does not do).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    usable, reason = te_status()
    if use_te is None:
        use_te = usable
    if use_te:
        if not usable:
            raise RuntimeError(f"the Transformer Engine spec was requested but {reason}")
        builder = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
        spec = builder(**spec_kwargs(builder, normalization=normalization))
        spec.submodules.self_attention.submodules.core_attention = te_core_attention()
        return spec
    builder = gpt_layer_specs.get_gpt_layer_local_spec
    spec = builder(**spec_kwargs(builder, normalization=normalization))
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def checkpoint_common_state(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The common (non-tensor) state of a megatron `dist_checkpointing` checkpoint directory.

    megatron-core up to 0.18 saves it with `torch.save` to `common.pt`; 0.19 stores it as one
    `ShardedObject` "common_state" inside the torch_dist checkpoint
    (dist_checkpointing/serialization.py, `load_common_state_dict`). Whichever the directory
    has is read, with torch's own checkpoint reader; a directory with neither raises
    `FileNotFoundError` naming both.
    """
    import io
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    path = Path(checkpoint_dir)
    if (path / "common.pt").is_file():
        return torch.load(path / "common.pt", weights_only=False)
    keys: list[str] = []
    if (path / ".metadata").is_file():
        meta = FileSystemReader(str(path)).read_metadata()
        keys = [k for k in meta.state_dict_metadata if k.split("/")[0] == "common_state"]
    if len(keys) != 1:
        raise FileNotFoundError(
            f"{path}: no common.pt and {len(keys)} 'common_state' objects in the torch_dist metadata "
            "(expected one of the two megatron-core layouts)"
        )
    holder: dict[str, Any] = {keys[0]: io.BytesIO()}
    dcp_load(holder, storage_reader=FileSystemReader(str(path)), no_dist=True)
    loaded = holder[keys[0]]  # the stored bytes, or (newer torch) the object read from them
    if isinstance(loaded, io.BytesIO):
        loaded.seek(0)
        loaded = torch.load(loaded, weights_only=False)
    return loaded[0]
