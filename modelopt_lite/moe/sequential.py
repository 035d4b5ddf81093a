"""MoE blocks whose experts are separate modules: an ``nn.ModuleList`` / ``nn.ModuleDict`` whose attribute
name contains ``expert`` (``experts``, ``local_experts``; remote-code DeepSeek / Qwen2-MoE, Switch
Transformers' ``expert_{i}``), each expert an MLP of ordinary linear layers with quantizers of their own.

An expert that calibration routes no token to leaves its activation quantizers without data.
:func:`amax_donors` finds, for each such quantizer, the same quantizer of the other experts of its layer;
calibration gives it the largest of their amax (see ``docs/moe.md``). :func:`record_amax_fills` keeps what
was filled on the experts container, for :func:`~.coverage.coverage_report`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from torch import nn

__all__ = [
    "amax_donors",
    "expert_containers",
    "record_amax_fills",
    "recorded_amax_fills",
    "split_expert_name",
]

#: Attribute of an experts container holding ``{quantizer: [donor quantizers]}`` of its last calibration.
_FILLS_ATTR = "_amax_from_other_experts"


def expert_containers(model: nn.Module) -> dict[str, list[str]]:
    """``{container name: [expert keys]}`` for every ``nn.ModuleList`` / ``nn.ModuleDict`` of two or more
    experts in ``model`` (an attribute whose name contains ``expert``, any case)."""
    containers: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if name and isinstance(module, (nn.ModuleList, nn.ModuleDict)) and "expert" in leaf.lower():
            keys = [key for key, _ in module.named_children()]
            if len(keys) > 1:
                containers[name] = keys
    return containers


def split_expert_name(name: str, containers: Mapping[str, list[str]]) -> tuple[str, str, str] | None:
    """``(container, expert key, path inside the expert)`` of a dotted name under an experts container (the
    innermost one), or ``None``."""
    parts = name.split(".")
    for i in range(len(parts) - 2, 0, -1):
        container = ".".join(parts[:i])
        if parts[i] in containers.get(container, ()):
            return container, parts[i], ".".join(parts[i + 1 :])
    return None


def amax_donors(
    empty: Iterable[str], calibrated: Iterable[str], containers: Mapping[str, list[str]]
) -> dict[str, list[str]]:
    """For each quantizer of ``empty`` that belongs to an expert: the same quantizer (same path inside the
    expert) of the other experts of its container that are among ``calibrated``, in the container's order.
    Quantizers outside experts, and those no other expert can give an amax to, are left out."""
    have = set(calibrated)
    donors: dict[str, list[str]] = {}
    for name in empty:
        split = split_expert_name(name, containers)
        if split is None:
            continue
        container, key, inside = split
        found = [
            f"{container}.{other}.{inside}"
            for other in containers[container]
            if other != key and f"{container}.{other}.{inside}" in have
        ]
        if found:
            donors[name] = found
    return donors


def record_amax_fills(model: nn.Module, calibrated: Iterable[str], fills: Mapping[str, list[str]]) -> None:
    """Note on each experts container which of its quantizers calibration just gave an amax from other
    experts (``fills``), forgetting earlier notes of every quantizer in ``calibrated`` (calibrated again)."""
    containers = expert_containers(model)
    modules = dict(model.named_modules())
    for name in calibrated:
        split = split_expert_name(name, containers)
        if split is not None:
            modules[split[0]].__dict__.get(_FILLS_ATTR, {}).pop(name, None)
    for name, donors in fills.items():
        split = split_expert_name(name, containers)
        if split is None:
            raise ValueError(f"{name} is not inside an experts container")
        modules[split[0]].__dict__.setdefault(_FILLS_ATTR, {})[name] = list(donors)


def recorded_amax_fills(model: nn.Module) -> dict[str, dict[str, list[str]]]:
    """``{container: {quantizer: [donor quantizers]}}`` noted by :func:`record_amax_fills` (containers with
    none left out)."""
    return {
        name: dict(fills)
        for name, module in model.named_modules()
        if (fills := module.__dict__.get(_FILLS_ATTR))
    }
