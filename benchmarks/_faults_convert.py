"""``benchmarks/faults.py --modes convert``: the real-model conversion (``real_model_path``, a GGUF file
dequantized into the cache) killed by SIGKILL at a random moment, then called again as a user would.

One child process per call, with ``MODELOPT_LITE_CACHE`` pointed at a folder of its own. An uninterrupted
conversion gives the reference (the SHA-256 of every file of the cached checkpoint) and its duration (from
the call of ``real_model_path`` to its return; transformers and gguf are imported before); each trial arms a
SIGKILL timer on entering that call, after a delay drawn uniformly from the reference's duration, then
converts again ("resumed"). Counted: kills (a kill that came after the call had returned, in a run faster
than the reference, is flagged ``after_the_call_returned``), resumes whose cached checkpoint equals the
reference file for file, and runs that failed or left something
half-written: a second call that raised, anything a converter stages left in the cache after it
(``.partial-``, ``.joined.gguf``, ``.old-``), or a checkpoint folder visible after the kill that was not the
complete one (no ``real_model.json``, or files that differ: the second call would have reused it).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import _harness as h

STAGING = (".partial-", ".joined.gguf", ".old-")


def child(out: Path, model: str, kill: str | None) -> None:
    """One call of ``real_model_path(model)`` into ``out/cache`` (``kill``: ``convert:DELAY``)."""
    import gguf  # noqa: F401  (imported before the clock starts: the kill window is the conversion's work)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from modelopt_lite.models.real import real_model_path

    def mark(phase: str) -> None:
        with open(out / "phases.jsonl", "a") as f:
            f.write(json.dumps({"phase": phase, "t": time.time()}) + "\n")

    mark("convert")
    if kill:
        delay = float(kill.split(":")[1])
        threading.Timer(delay, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    path = real_model_path(model)
    mark("done")
    (out / "path.txt").write_text(str(path))


def _spawn(out: Path, model: str, threads: int, kill: str | None = None) -> tuple[int, str]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, h.REPO_ROOT + "/benchmarks/faults.py", "--child", str(out), "--mode", "convert",
           "--gguf", model, "--threads", str(threads)] + (["--kill", kill] if kill else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "MODELOPT_LITE_CACHE": str(out / "cache")}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    return proc.returncode, h.portable_text(proc.stderr[-2000:])


def _root(out: Path) -> Path:
    return out / "cache" / "real_models"


def cache_state(out: Path) -> dict:
    """What the cache holds: ``checkpoints`` (visible folders: name -> complete?), ``staging`` (what a
    converter stages), ``other`` (anything else but the lock files)."""
    root = _root(out)
    entries = sorted(root.iterdir()) if root.is_dir() else []
    state: dict = {"checkpoints": {}, "staging": [], "other": []}
    for p in entries:
        if any(s in p.name for s in STAGING):
            state["staging"].append(p.name)
        elif p.name.startswith(".") and p.name.endswith(".lock"):
            continue
        elif p.is_dir() and not p.name.startswith("."):
            state["checkpoints"][p.name] = (p / "real_model.json").is_file()
        else:
            state["other"].append(p.name)
    return state


def digest(out: Path) -> dict[str, str]:
    """SHA-256 of every file of every visible checkpoint folder in the cache (by relative path)."""
    root = _root(out)
    found = {}
    for name in cache_state(out)["checkpoints"]:
        for p in sorted((root / name).rglob("*")):
            if p.is_file():
                found[str(p.relative_to(root))] = _sha256(p)
    return found


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def _marks(out: Path) -> dict[str, float]:
    path = out / "phases.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return {m["phase"]: m["t"] for m in map(json.loads, lines)}


def measure(
    model: str, kills: int, threads: int, work: Path, rng: random.Random, progress: Any = None
) -> dict:
    """The mode's rows and trials (``progress(result)`` after each trial: what is measured so far)."""
    ref = work / "convert_reference"
    code, err = _spawn(ref, model, threads)
    if code != 0:
        raise RuntimeError(f"convert: the uninterrupted conversion failed (rc {code}): {err}")
    marks = _marks(ref)
    duration = marks["done"] - marks["convert"]
    reference = digest(ref)
    h.log(f"convert: reference conversion of {model} took {duration:.1f} s ({len(reference)} files)")
    row = {"kills": 0, "exact": 0, "failed_or_partial": 0, "not_killed": 0}
    trials: list[dict] = []
    result = {"rows": {"conversion": row}, "trials": trials, "conversion_seconds": round(duration, 2),
              "model": model, "reference_files": reference}  # fmt: skip
    for i in range(kills):
        out = work / f"convert_{i}"
        delay = rng.uniform(0, duration)
        code, _ = _spawn(out, model, threads, kill=f"convert:{delay:.4f}")
        if code != -signal.SIGKILL:
            row["not_killed"] += 1
            shutil.rmtree(out, ignore_errors=True)
            continue
        row["kills"] += 1
        returned = "done" in _marks(out)  # (killed after real_model_path had returned: a faster run)
        after_kill = cache_state(out)
        visible = digest(out)
        # a folder visible after the kill is what a second call reuses: it must be the whole reference
        trusted_partial = bool(after_kill["checkpoints"]) and visible != reference
        code, err = _spawn(out, model, threads)
        after = cache_state(out)
        exact = code == 0 and digest(out) == reference
        bad = code != 0 or bool(after["staging"] or after["other"]) or trusted_partial
        row["exact"] += exact
        row["failed_or_partial"] += bad
        trials.append({
            "delay_s": round(delay, 3), "after_the_call_returned": returned, "left_by_the_kill": after_kill,
            "resume_rc": code, "exact": exact, "left_after_resume": after,
            **({"resume_error": err} if code else {}),
        })  # fmt: skip
        left = after_kill["staging"] or list(after_kill["checkpoints"]) or ["nothing"]
        when = " (after the call returned)" if returned else ""
        h.log(f"convert #{i}: killed after {delay:.2f} s{when}, left {left}; converted again exact={exact}")
        shutil.rmtree(out, ignore_errors=True)  # (each cached checkpoint is hundreds of MB)
        if progress is not None:
            progress(result)
    shutil.rmtree(ref / "cache", ignore_errors=True)
    return result


def write_tiny_gguf(path: Path, layers: int = 2, hidden: int = 64, seed: int = 0) -> Path:
    """A tiny Llama GGUF file (float32 tensors, a byte-level vocabulary of 256 tokens) that transformers
    converts in about a second: the quick mode's stand-in for a real model (needs ``gguf``)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab, inter, heads, kv = 256, 2 * hidden, 4, 2
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny-llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(_byte_tokens())
    w.add_token_types([1] * vocab)
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def tensor(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))

    tensor("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    head = hidden // heads
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        tensor(f"blk.{i}.attn_q.weight", hidden, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv * head, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv * head, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, hidden)
        tensor(f"blk.{i}.ffn_gate.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_up.weight", inter, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _byte_tokens() -> list[str]:
    """GPT-2's 256 byte-level tokens, in byte order (the printable bytes as themselves, the rest shifted)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    shifted, out = 0, []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + shifted))
            shifted += 1
    return out
