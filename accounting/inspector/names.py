"""Layer names as nvdlfw-inspect assigns them, so one regex selects the same layers in both backends."""

from __future__ import annotations

import torch


def layer_names(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Every module under `model`, named the way nvdlfw-inspect names them.

    The root is `model`; children are `<parent>.<attribute>`, except that the children of a
    `ModuleList` are named by their `layer_number` attribute when they have one (megatron-core's
    1-based global layer index, which differs between pipeline stages). A list of model chunks
    (virtual pipeline) is walked chunk by chunk under the same root name, as nvdlfw-inspect does.
    Wrappers are not stripped: each wrapper that holds the model as `.module` (DDP,
    `Float16Module`) adds one `.module` level, exactly as in nvdlfw-inspect's names (which TE
    uses for the statistics it logs), so `model.module.module.decoder...` under bf16.
    """
    names: dict[str, torch.nn.Module] = {}

    def walk(module: torch.nn.Module, name: str) -> None:
        if isinstance(module, torch.nn.ModuleList):
            for attr, child in module.named_children():
                walk(child, f"{name}.{getattr(child, 'layer_number', attr)}")
            return
        names.setdefault(name, module)
        for attr, child in module.named_children():
            walk(child, f"{name}.{attr}")

    for chunk in model if isinstance(model, list) else [model]:
        walk(chunk, "model")
    return names
