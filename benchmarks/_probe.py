"""What ``kv_cache_probe.py`` and ``awq_probe.py`` share: a ``real_ptq.py --workdir`` read back (its token
windows and the unquantized model's stored log-probabilities) and the model loaded again in float32."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_flags(p: argparse.ArgumentParser, eval_windows: int) -> None:
    p.add_argument("--model", default="qwen2.5-coder-1.5b", help="a real model of modelopt_lite.models")
    p.add_argument("--model-dir", help="a Hugging Face checkpoint folder instead of --model")
    p.add_argument("--workdir", required=True, help="a real_ptq.py --workdir of the same model")
    p.add_argument("--eval-windows", type=int, default=eval_windows)


def inputs(args: argparse.Namespace) -> tuple[dict[str, Any], Any, Path, Callable[[], Any]]:
    """``(data, test, ref_dir, load)``: the stored ``calib`` / ``test`` windows, the first
    ``--eval-windows`` test windows, the folder of their unquantized log-probabilities, and a function
    that loads a fresh float32 copy of the model in eval mode."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from modelopt_lite.models import real_model_path

    work = Path(args.workdir)
    data = load_file(str(work / "data.safetensors"))

    def load() -> Any:
        path = args.model_dir or real_model_path(args.model)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    return data, data["test"][: args.eval_windows], work / "reference_logprobs", load
