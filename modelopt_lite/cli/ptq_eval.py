"""The PTQ command line's measurements, with one copy of the model in memory: the memory check before the
model is loaded, the unquantized model's held-out logits (written to a temporary file before quantization,
read back window by window) and greedy continuations (generated before quantization), the comparison after
it, and the peak memory.

The unquantized model is not copied: quantization works in place, and a copy would double the peak (two
full models of 7.1 GB at 1.5B parameters in float32). Its held-out logits are what the comparison needs of
it; they go to disk in the logits' dtype (``windows x window x vocabulary`` elements, 4.98 GB for 16 x 512
tokens at Qwen2.5's vocabulary of 151936 in float32) and come back exactly as computed, so the figures
equal those of a comparison with a kept copy, bit for bit (tested).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import evaluation
from ..logging import get_logger
from ..models.gguf import check_memory

__all__ = ["Phases", "Reference", "check_load_memory", "forward_speed", "peak_rss"]

logger = get_logger(__name__)
# the command's peak beside the model: calibration / evaluation activations, the allocator's slack
RUN_MEMORY_FACTOR = 1.3


def _element_size(dtype: Any) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 4


def check_load_memory(ckpt: str, model_config: Any, dtype: str) -> None:
    """Refuse before loading a local checkpoint that would not fit the memory left: its weights in the run's
    ``dtype`` (the safetensors files' size scaled from the stored dtype) times ``RUN_MEMORY_FACTOR``, or,
    where the dtypes differ, what transformers' load holds (the stored and the converted weights)."""
    files = list(Path(ckpt).glob("*.safetensors")) if Path(ckpt).is_dir() else []
    if not files:
        return
    stored = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
    ratio = (_element_size(stored) if dtype == "auto" else _element_size(dtype)) / _element_size(stored)
    on_disk = sum(f.stat().st_size for f in files)
    weights = on_disk * ratio
    need = max(RUN_MEMORY_FACTOR * weights, on_disk + weights if ratio != 1 else 0)
    check_memory(
        int(need),
        f"the PTQ of {ckpt} ({weights / 1e9:.1f} GB of weights in {dtype if dtype != 'auto' else stored})",
        "pass --dtype bfloat16, or run on a machine with more memory",
    )


class Reference:
    """The unquantized model's side of the comparison, taken before quantization: its held-out logits in a
    temporary file and its greedy continuations; ``close`` (or the ``with`` block's end) removes the file."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        held_out: torch.Tensor | None,
        prompts: list[str],
        args: argparse.Namespace,
        times: Phases,
    ) -> None:
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.logits: evaluation.StoredLogits | None = None
        if held_out is not None:
            self._dir = tempfile.TemporaryDirectory(prefix="modelopt_lite-ptq-")
            vocab = model.get_output_embeddings().weight.shape[0]
            need = evaluation.stored_logits_bytes(held_out, vocab, next(model.parameters()).dtype)
            free = shutil.disk_usage(self._dir.name).free
            if need > free:
                self.close()
                raise ValueError(
                    "the held-out comparison writes the unquantized model's logits to "
                    f"{tempfile.gettempdir()}: {need / 1e9:.1f} GB ({held_out.shape[0]} windows x "
                    f"{held_out.shape[1]} tokens x {vocab} vocabulary), {free / 1e9:.1f} GB free; lower "
                    "--eval_size / --eval_seq or set TMPDIR to a larger disk"
                )
            logger.info(
                "unquantized held-out logits: %.2f GB to a temporary file (read back window by window "
                "after quantization; no copy of the model is kept)", need / 1e9,
            )  # fmt: skip
            with times.phase("unquantized evaluation"):
                self.logits = evaluation.store_logits(model, held_out, Path(self._dir.name) / "logits.bin",
                                                      args.batch_size)  # fmt: skip
        self.continuations = []
        if prompts:
            with times.phase("unquantized generation"):
                self.continuations = evaluation.greedy_continuations(
                    model, tokenizer, prompts, args.gen_tokens
                )

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> Reference:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compare(
        self,
        args: argparse.Namespace,
        model: Any,
        tokenizer: Any,
        held_out: torch.Tensor | None,
        prompts: list[str],
        times: Phases,
    ) -> None:
        """Log the held-out comparison and both models' greedy continuations (``times``: their seconds)."""
        if held_out is not None and self.logits is not None:
            with times.phase("evaluation"):
                self._evaluate(args, model, held_out)
        if prompts:
            with times.phase("generation"):
                after = evaluation.greedy_continuations(model, tokenizer, prompts, args.gen_tokens)
            for prompt, before, quantized in zip(prompts, self.continuations, after, strict=True):
                logger.info(
                    "greedy continuation of %r\n  unquantized: %r\n  quantized:   %r",
                    prompt,
                    before,
                    quantized,
                )

    def _evaluate(self, args: argparse.Namespace, model: Any, held_out: torch.Tensor) -> None:
        if self.logits is not None:  # (known: compare calls it only then; this narrows the type)
            logger.info("held-out evaluation: %s", evaluation.describe(held_out))
            result = evaluation.compare(self.logits, model, held_out, args.batch_size)
            ppl0, ppl1 = result.reference_perplexity, result.perplexity
            logger.info(
                "held-out perplexity: %.3f before, %.3f after quantization (%+.1f%%)", ppl0, ppl1,
                100 * (ppl1 / ppl0 - 1),
            )  # fmt: skip
            logger.info(
                "held-out KL(unquantized || quantized): %.3e nats per predicted token; top-1 agreement %.3f",
                result.kl, result.top1_agreement,
            )  # fmt: skip


def forward_speed(times: dict[str, float], calib_tokens: int, eval_tokens: int | None) -> str:
    """Tokens per second of the unquantized evaluation, the calibration and the quantized evaluation, the
    latter two also as their time per token over the unquantized one (the cost of the quantizers)."""
    base = times.get("unquantized evaluation")
    parts = []
    if base and eval_tokens:
        parts.append(f"unquantized evaluation {eval_tokens / base:.0f} tokens/s")
    for phase, tokens in (("calibration", calib_tokens), ("evaluation", eval_tokens)):
        if times.get(phase) and tokens:
            ratio = (
                f" ({times[phase] / tokens / (base / eval_tokens):.2f}x its time per token)" if base else ""
            )
            name = "quantized evaluation" if phase == "evaluation" else phase
            parts.append(f"{name} {tokens / times[phase]:.0f} tokens/s{ratio}")
    return "; ".join(parts)


def _peak_bytes() -> float | None:
    try:
        import resource
    except ImportError:  # not POSIX
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return float(peak if sys.platform == "darwin" else peak * 1024)


def peak_rss() -> str:
    """This process' peak resident memory (Linux, macOS), or "unknown"."""
    peak = _peak_bytes()
    return "unknown" if peak is None else f"{peak / 1e9:.2f} GB (resident)"


class Phases(dict[str, float]):
    """Seconds per phase of the command (a dict, in the order run), and the process' peak resident memory at
    the end of each phase (``peaks``: the peak reached during the first phase that ends above it)."""

    def __init__(self) -> None:
        super().__init__()
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        clock = time.perf_counter()
        yield
        self[name] = time.perf_counter() - clock
        peak = _peak_bytes()
        if peak is not None:
            self.peaks[name] = peak

    def summary(self) -> str:
        """``load 7.8 s (peak 4.10 GB), ...; 211.7 s in all``."""
        parts = [f"{k} {v:.1f} s" + (f" (peak {self.peaks[k] / 1e9:.2f} GB)" if k in self.peaks else "")
                 for k, v in self.items()]  # fmt: skip
        return f"{', '.join(parts)}; {sum(self.values()):.1f} s in all"
