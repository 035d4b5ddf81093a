"""Quickstart: fake-quantize every linear weight of a tiny Llama built from a config, in each format,
and report how far the logits move. Runs offline on CPU in seconds.

    python examples/quickstart.py [--hidden 128] [--layers 2]

The full PTQ command line (``examples/llm_ptq/hf_ptq.py`` on the bundled default model) arrives with the
export work; this script exercises the fake-quant core it is built on.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelopt_lite.nn import TensorQuantizer

FORMATS = {
    "int8 per-channel": {"num_bits": 8, "axis": 0},
    "int4 block-128": {"num_bits": 4, "block_sizes": {-1: 128}},
    "fp8 e4m3 per-tensor": {"num_bits": (4, 3)},
    "nvfp4": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
    "mxfp8": {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
    "mxfp4": {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        reference = model(tokens).logits
    originals = {n: m.weight.detach().clone() for n, m in model.named_modules() if _is_linear(n, m)}
    print(f"tiny Llama: {sum(w.numel() for w in originals.values()):,} quantizable weights")
    print(f"{'format':<22} {'weight rel. MSE':>16} {'logits rel. err':>16} {'seconds':>8}")
    for name, attrs in FORMATS.items():
        start = time.perf_counter()
        w_err = []
        with torch.no_grad():
            for mod_name, module in model.named_modules():
                if mod_name not in originals:
                    continue
                w = originals[mod_name]
                q = TensorQuantizer(f"{mod_name}.weight_quantizer", **attrs).calibrate(w)
                module.weight.copy_(q(w))
                w_err.append(float((module.weight - w).pow(2).mean() / w.pow(2).mean()))
            logits = model(tokens).logits
        rel = float((logits - reference).norm() / reference.norm())
        elapsed = time.perf_counter() - start
        print(f"{name:<22} {sum(w_err) / len(w_err):>16.3e} {rel:>16.3e} {elapsed:>8.2f}")
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if mod_name in originals:
                module.weight.copy_(originals[mod_name])


def _is_linear(name: str, module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) and "lm_head" not in name


if __name__ == "__main__":
    main()
