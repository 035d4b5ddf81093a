"""Quickstart: post-training quantize a tiny Llama (built from a config, no download) with each preset,
calibrating on a few batches, and report how far the logits move; then save and restore one quantized
model. Runs offline on CPU in seconds.

    python examples/quickstart.py [--hidden 128] [--layers 2]

The full PTQ command line (``examples/llm_ptq/hf_ptq.py`` on the bundled default model) arrives with the
export work; this script exercises the ``mtq`` / ``mto`` API it is built on.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq
from modelopt_lite.logging import set_verbosity

PRESETS = [
    "INT8_DEFAULT_CFG",
    "INT8_WEIGHT_ONLY_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "FP8_DEFAULT_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "NVFP4_DEFAULT_CFG",
    "W4A16_NVFP4_CFG",
    "MXFP8_DEFAULT_CFG",
    "MXFP4_DEFAULT_CFG",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    set_verbosity("WARNING")  # the table below is the output; INFO would log each calibration
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 4,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    base = LlamaForCausalLM(config).eval()
    calib = [torch.randint(0, 512, (2, 64)) for _ in range(4)]
    tokens = torch.randint(0, 512, (2, 64))
    with torch.no_grad():
        reference = base(tokens).logits
    print(
        f"tiny Llama, {sum(p.numel() for p in base.parameters()):,} parameters; 4 calibration batches of 2x64"
    )
    print(f"{'preset (+ FP8 KV cache)':<34} {'enabled':>8} {'logits rel. err':>16} {'seconds':>8}")
    for name in PRESETS:
        model = copy.deepcopy(base)
        start = time.perf_counter()
        mtq.quantize(model, mtq.with_kv_cache(mtq.get_preset(name), "FP8_KV_CFG"), calib)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            err = ((model(tokens).logits - reference).norm() / reference.norm()).item()
        enabled = sum(q.is_enabled for _, q in mtq.iter_quantizers(model))
        print(f"{name:<34} {enabled:>8} {err:>16.4f} {seconds:>8.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = mto.save(model, Path(tmp) / "mxfp4.safetensors")
        fresh = LlamaForCausalLM(config).eval()
        mto.restore(fresh, path)
        with torch.no_grad():
            same = torch.equal(fresh(tokens).logits, model(tokens).logits)
        print(f"mto.save -> mto.restore onto a fresh model: logits bit-identical = {same}")


if __name__ == "__main__":
    main()
