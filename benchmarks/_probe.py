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
    p.add_argument(
        "--split", default="test", choices=("test", "validation"),
        help="test: real_ptq.py's stored test windows; validation: windows of the corpus' validation split "
        "(made and their unquantized log-probabilities stored in --workdir on first use), to choose between "
        "levers on text that the reported rows never see",
    )  # fmt: skip


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
    path = args.model_dir or real_model_path(args.model)

    def load() -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    if args.split == "test":
        return data, data["test"][: args.eval_windows], work / "reference_logprobs", load
    return data, *_validation(work, path, data["test"].shape[1], args.eval_windows, load), load


def _validation(work: Path, path: Any, seq: int, count: int, load: Callable[[], Any]) -> tuple[Any, Path]:
    """``count`` windows of ``seq`` tokens of the validation split and their unquantized log-probabilities
    (batches of 4, as ``real_ptq.py`` stores the test windows'), made once per ``--workdir``."""
    import _real_ptq_peer as peer
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from modelopt_lite.data import token_stream, windows
    from modelopt_lite.models import corpus_texts

    stem = f"validation_{count}x{seq}"
    file, ref_dir = work / f"{stem}.safetensors", work / f"{stem}_logprobs"
    if not file.exists() or not ref_dir.exists():
        tok = AutoTokenizer.from_pretrained(str(path))
        val = windows(token_stream(tok, corpus_texts("validation")), seq, count, "validation split")
        if len(val) < count:
            raise ValueError(f"the corpus has {len(val)} validation windows of {seq} tokens; {count} asked")
        with torch.no_grad():
            peer.write_reference(load(), val, ref_dir, 4)
        save_file({"validation": val.contiguous()}, str(file))  # last: its presence marks both complete
    return load_file(str(file))["validation"], ref_dir
