"""``rotate_residual``: an offline rotation of the residual stream, absorbed into the weights (QuaRot /
SpinQuant "R1"), to run before ``mtq.quantize``.

A decoder-only transformer reads its residual stream ``h`` only through RMSNorms followed by linear layers,
and writes to it only through the attention output and MLP down projections (and the embeddings). With an
orthogonal ``Q`` (``Q Q^T = I``), replacing ``h`` by ``h Q`` everywhere leaves the model's function unchanged
once

1. each RMSNorm scale ``g`` is folded into the linear layers that read it (``W <- W diag(g)``, ``g <- 1``): an
   RMSNorm without a scale commutes with ``Q`` (``rms(h Q) = rms(h)``);
2. every layer that reads the stream gets ``W <- W Q`` (q / k / v, gate / up, the MoE router and each fused
   expert's ``gate_up_proj``, the LM head), every layer that writes it ``W <- Q^T W`` (and ``b <- Q^T b``:
   o_proj, down_proj, each expert's ``down_proj``), and the embedding table ``E <- E Q``.

The result is an ordinary checkpoint of the same architecture (every engine loads it; norms hold ones). What
changes is the activations the quantizers see: the inputs of q / k / v, gate / up and the router are rotated,
which spreads outlier channels over all channels (fewer extreme values per NVFP4 block). The inputs of
o_proj and down_proj are not rotated (that needs an online transform, "R4", which no checkpoint carries).

``Q`` is a Hadamard matrix with random signs (``kind="hadamard"``, hidden size a power of two) or a random
orthogonal matrix from the QR decomposition of a Gaussian one (``kind="random"``); ``"auto"`` takes the
first where it applies. Computed in float64, cast back to each weight's dtype. A tied LM head is untied
first (the head gets the final norm folded in, the embeddings do not).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..formats import hadamard_matrix
from ..logging import get_logger
from .model_quant import quant_state

__all__ = ["rotate_residual", "rotation_matrix"]

logger = get_logger(__name__)
_KINDS = ("auto", "hadamard", "random")


def rotation_matrix(dim: int, kind: str = "auto", seed: int = 0) -> torch.Tensor:
    """An orthogonal ``(dim, dim)`` float64 matrix (see the module docstring for ``kind``)."""
    if kind not in _KINDS:
        raise ValueError(f"kind={kind!r} (allowed: {_KINDS})")
    power_of_two = dim > 0 and dim & (dim - 1) == 0
    if kind == "hadamard" and not power_of_two:
        raise ValueError(f"kind='hadamard' needs a power-of-two size, got {dim}; use kind='random'")
    gen = torch.Generator().manual_seed(seed)
    if kind == "random" or not power_of_two:
        q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))  # unique, uniformly distributed
    h = hadamard_matrix(dim, torch.float64)
    signs = torch.randint(0, 2, (dim,), generator=gen).to(torch.float64) * 2 - 1
    return (h / math.sqrt(dim)) * signs  # H D: orthogonal


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


def _fold_norm(norm: nn.Module, readers: list[torch.Tensor], where: str) -> None:
    """``W <- W diag(g)`` for every reader weight (last axis = hidden), then ``g <- 1``."""
    name = type(norm).__name__
    if not name.endswith("RMSNorm") or name.startswith("Gemma") or getattr(norm, "bias", None) is not None:
        raise NotImplementedError(
            f"{where}: {name} is not a plain RMSNorm (x / rms(x) * weight); rotate_residual supports "
            "Llama / Qwen / Mistral-style decoders"
        )
    g = norm.weight.detach().double()
    for w in readers:
        _set(w, w.detach().double() * g)
    _set(norm.weight, torch.ones_like(g))


def _readers_writers(layer: nn.Module, where: str) -> tuple[list, list, list, list]:
    """``(attention readers, attention writers, mlp readers, mlp writers)`` weight tensors of one decoder
    layer, each with the hidden size on its last axis (readers) or on its first axis after the expert one
    (writers: ``(out = hidden, in)`` or ``(experts, hidden, in)``)."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(hasattr(attn, n) for n in names):
        raise NotImplementedError(f"{where}: no self_attn with q_proj / k_proj / v_proj / o_proj")
    a_read = [getattr(attn, n).weight for n in names[:3]]
    a_write = [attn.o_proj.weight] + ([attn.o_proj.bias] if attn.o_proj.bias is not None else [])
    if mlp is not None and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
        m_read = [mlp.gate_proj.weight, mlp.up_proj.weight]
        m_write = [mlp.down_proj.weight] + ([mlp.down_proj.bias] if mlp.down_proj.bias is not None else [])
    elif mlp is not None and hasattr(mlp, "gate") and hasattr(getattr(mlp, "experts", None), "gate_up_proj"):
        experts = mlp.experts
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
            raise NotImplementedError(f"{where}: experts with biases or transposed weights are not supported")
        m_read = [mlp.gate.weight, experts.gate_up_proj]
        m_write = [experts.down_proj]
        if hasattr(mlp, "shared_expert"):
            raise NotImplementedError(f"{where}: shared experts are not supported yet")
    else:
        raise NotImplementedError(
            f"{where}: {type(mlp).__name__} is neither a gated MLP nor fused MoE experts"
        )
    return a_read, a_write, m_read, m_write


def rotate_residual(model: nn.Module, kind: str = "auto", seed: int = 0) -> dict[str, Any]:
    """Rotate the residual stream of an unquantized decoder-only ``model`` in place (module docstring);
    returns ``{"kind", "dim", "seed"}``, also recorded as ``model.config.modelopt_lite_rotation``."""
    if quant_state(model) is not None:
        raise ValueError(
            "rotate_residual changes the weights: call it before mtq.quantize, on the unquantized model"
        )
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if layers is None or embed is None or head is None or not hasattr(base, "norm"):
        raise NotImplementedError(
            f"{type(model).__name__}: rotate_residual needs a decoder-only LM with model.layers, model.norm, "
            "input embeddings and an LM head"
        )
    dim = embed.weight.shape[1]
    if kind == "auto":
        kind = "hadamard" if dim & (dim - 1) == 0 else "random"
    q = rotation_matrix(dim, kind, seed)
    if head.weight is embed.weight:
        head.weight = nn.Parameter(embed.weight.detach().clone())
        model.config.tie_word_embeddings = False
        logger.info("rotate_residual: untied the LM head from the input embeddings")
    plan = [_readers_writers(layer, f"model.layers.{i}") for i, layer in enumerate(layers)]
    for i, (layer, (a_read, a_write, m_read, m_write)) in enumerate(zip(layers, plan, strict=True)):
        _fold_norm(layer.input_layernorm, a_read, f"model.layers.{i}.input_layernorm")
        _fold_norm(layer.post_attention_layernorm, m_read, f"model.layers.{i}.post_attention_layernorm")
        for w in a_read + m_read:
            _set(w, w.detach().double() @ q)
        for w in a_write + m_write:
            _set(w, q.T @ w.detach().double())
    _fold_norm(base.norm, [head.weight], "model.norm")
    _set(head.weight, head.weight.detach().double() @ q)
    _set(embed.weight, embed.weight.detach().double() @ q)
    record = {"kind": kind, "dim": dim, "seed": seed}
    model.config.modelopt_lite_rotation = record
    logger.info("rotated the residual stream (%s, dim %d, seed %d) of %d layers", record["kind"], dim, seed,
                len(layers))  # fmt: skip
    return record
