"""The torch-hook backend: forward and tensor-gradient hooks that live for one inspection step."""

from __future__ import annotations

from typing import Any

import torch

from accounting.inspector.tensor_stats import partial_stats

Rows = dict[tuple[str, str], list[torch.Tensor]]


class HookRecorder:
    """Reduces the matched modules' tensors to partial-statistics rows between attach and detach.

    Nothing is registered outside an inspection step, so an off-step costs nothing. Each tensor
    becomes one device-side row at once (no activation kept alive, no host sync); the weight is
    taken once per step however many microbatches run.
    """

    def __init__(
        self,
        modules: dict[str, torch.nn.Module],
        tensors: tuple[str, ...],
        skip: frozenset[tuple[str, str]] = frozenset(),
    ) -> None:
        self.modules = modules
        self.tensors = tensors
        self.skip = skip  # (layer, tensor) pairs another backend records as a different tensor
        self._handles: list[Any] = []
        self._rows: Rows = {}
        self._weights_seen: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        """Register one forward hook per matched module (the gradient hooks follow per call)."""
        self._rows = {}
        self._weights_seen = set()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name), with_kwargs=True))

    def detach(self) -> Rows:
        """Remove every hook and hand over the rows gathered since `attach`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        rows, self._rows = self._rows, {}
        return rows

    def _add(self, layer: str, tensor_name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            self._rows.setdefault((layer, tensor_name), []).append(partial_stats(tensor))

    def _forward_hook(self, layer: str):
        wanted = tuple(t for t in self.tensors if (layer, t) not in self.skip)

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            inp = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            # megatron's parallel linears return (output, bias): the tensor is the first item.
            out = output[0] if isinstance(output, (tuple, list)) else output
            if "activation" in wanted:
                self._add(layer, "activation", inp)
            if "output" in wanted:
                self._add(layer, "output", out)
            if "weight" in wanted and layer not in self._weights_seen:
                self._weights_seen.add(layer)
                self._add(layer, "weight", getattr(module, "weight", None))
            if "gradient" in wanted and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._add(layer, "gradient", g))
            if "dgrad" in wanted and isinstance(inp, torch.Tensor) and inp.requires_grad:
                inp.register_hook(lambda g: self._add(layer, "dgrad", g))

        return hook
