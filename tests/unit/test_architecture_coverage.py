"""Architecture coverage (docs/coverage.md, issue 41): every architecture of ``ARCHITECTURES`` through every
job of ``JOBS`` on a tiny model built from a config in code (hidden 64, 1-2 layers, vocabulary 128, fixed
seed, no download). ``python benchmarks/coverage_table.py`` runs this file and writes the outcomes into the
table of docs/coverage.md; the last test fails when that table lists other architectures or jobs than these.

Jobs: PTQ per format (``ptq_<qformat>``: the command line's config for the format, every linear layer and
fused experts projection quantized and calibrated, routers and ``lm_head`` not, logits finite and within a
bound of the float model's), ``export`` (per format: the checkpoint's ``quant_algo`` and every quantized layer
stored packed), ``reload`` (``from_pretrained`` of the export: the fake-quant model's logits with its
activation quantizers off), ``compress`` (``mtq.compress``: the fake-quant model's logits bit for bit when
dequantizing; W8A8 also on the int8 GEMM) and ``qad`` (two ``QADTrainer`` steps, NVFP4).

A combination refused by design asserts its documented error (``REFUSED``) and records the reason for the
table; a known library bug is an ``xfail(strict=True)`` (``KNOWN_BUGS``) with the error, so that a fix
shows."""

from __future__ import annotations

import copy
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.pytorch_utils import Conv1D

import modelopt_lite.quantization as mtq
from modelopt_lite.cli.ptq_config import build_config
from modelopt_lite.export import UnsupportedFormatError, export_hf_checkpoint

from ._export_cases import hf_quant, tensors
from ._models import (
    VOCAB,
    batches,
    tiny_gpt2,
    tiny_gpt_oss,
    tiny_llama,
    tiny_llama4,
    tiny_qwen3,
    tiny_qwen3_moe,
)
from ._training import CountingData, cpu_args, step_losses

REPO = Path(__file__).resolve().parents[2]
COVERAGE_PAGE = REPO / "docs" / "coverage.md"
BEGIN, END = "<!-- coverage:begin -->", "<!-- coverage:end -->"


# ------------------------------------------------------------------------ tiny models of the other families


def tiny_qwen2(seed: int = 0):
    """Qwen2: q/k/v projections with biases, an untied ``lm_head``."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


def tiny_gemma3_text(seed: int = 0):
    """Gemma 3 text: q/k norms, a sliding-window layer (window 8 < the 16 tokens of a batch) then a global
    one, head dimension 16, tied embeddings."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, vocab_size=VOCAB,
        max_position_embeddings=64, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    return Gemma3ForCausalLM(cfg).eval()


def tiny_mistral(seed: int = 0):
    """Mistral: Llama's layers with sliding-window attention (window 8)."""
    torch.manual_seed(seed)
    cfg = MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=8,
        attn_implementation="sdpa",
    )  # fmt: skip
    return MistralForCausalLM(cfg).eval()


def tiny_phi3(seed: int = 0):
    """Phi-3: fused ``qkv_proj`` and ``gate_up_proj`` linear layers."""
    torch.manual_seed(seed)
    cfg = Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attn_implementation="sdpa",
    )  # fmt: skip
    return Phi3ForCausalLM(cfg).eval()


#: architecture (``config.model_type``) -> its tiny model; the rows of docs/coverage.md, in this order
ARCHITECTURES = {
    "llama": tiny_llama,
    "mistral": tiny_mistral,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
    "gemma3_text": tiny_gemma3_text,
    "phi3": tiny_phi3,
    "gpt2": tiny_gpt2,
    "qwen3_moe": tiny_qwen3_moe,
    "gpt_oss": tiny_gpt_oss,
    "llama4": tiny_llama4,
}


@dataclass(frozen=True)
class Format:
    algo: str  #: the export's quant_algo
    weight_bits: object  #: the weight quantizers' num_bits
    activations: bool  #: whether the inputs of the quantized layers are quantized too
    max_rel_error: float  #: bound on ||logits - float logits|| / ||float logits|| (measured up to 0.44)


#: ``--qformat`` of the PTQ command line -> what it must give. 8-bit formats stay within 0.35 of the float
#: logits and 4-bit ones within 0.6 on every tiny model (measured: at most 0.23 and 0.44, Gemma 3, whose
#: random weights amplify the per-layer error, itself Llama's); a scale off by a factor gives about 1.
FORMATS = {
    "fp8": Format("FP8", (4, 3), True, 0.35),
    "int8_sq": Format("W8A8_SQ_PER_CHANNEL", 8, True, 0.35),
    "int4_awq": Format("W4A16_AWQ", 4, False, 0.6),
    "nvfp4": Format("NVFP4", (2, 1), True, 0.6),
    "w4a16_nvfp4": Format("W4A16_NVFP4", (2, 1), False, 0.6),
    "mxfp8": Format("MXFP8", (4, 3), True, 0.35),
}
#: the columns of docs/coverage.md, in this order
JOBS = [*(f"ptq_{f}" for f in FORMATS), "export", "reload", "compress", "qad"]


@dataclass(frozen=True)
class Refusal:
    error: type[BaseException]
    match: str  #: the documented message (a regex)
    reason: str  #: the table's cell


_INTERLEAVED = Refusal(
    UnsupportedFormatError,
    r"mlp\.experts\.gate_up_proj\[0\]: QuantGptOssExperts interleaves the gate and up rows",
    "GPT-OSS's interleaved gate / up rows export in FP8 and NVFP4 only",
)
#: (architecture, job, qformat) -> the documented error of a combination refused by design
REFUSED = {("gpt_oss", "export", f): _INTERLEAVED for f in ("int8_sq", "int4_awq", "mxfp8")}
#: (architecture, job) -> (error, reason) of a library bug this file found: an xfail(strict=True) until fixed
KNOWN_BUGS: dict[tuple[str, str], tuple[type[Exception], str]] = {}  # (architecture, job) -> (error, reason)


def _params(job: str, formats: bool = True) -> list:
    """The (arch, fmt) or (arch,) parameters of a job, a known bug's marked xfail(strict=True)."""
    out = []
    for arch in ARCHITECTURES:
        bug = KNOWN_BUGS.get((arch, job))
        marks = [pytest.mark.xfail(strict=True, raises=bug[0], reason=bug[1])] if bug else []
        for fmt in FORMATS if formats else [None]:
            values = (arch, fmt) if formats else (arch,)
            out.append(pytest.param(*values, marks=marks, id="-".join(v for v in values if v)))
    return out


@pytest.fixture(autouse=True)
def _cell(request, record_property):
    """Record which cell of the table a test fills (read by benchmarks/coverage_table.py)."""
    params = getattr(request.node, "callspec", None)
    if params is None:
        return
    arch, fmt = params.params.get("arch"), params.params.get("fmt")
    job = request.node.originalname.removeprefix("test_")
    record_property("coverage", {"arch": arch, "job": f"ptq_{fmt}" if job == "ptq" else job, "format": fmt})


# ------------------------------------------------------------------------------------------ helpers


def _ids() -> torch.Tensor:
    return batches(n=1, seed=7)[0]


def _logits(model: torch.nn.Module, ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids() if ids is None else ids).logits


def _layers(model: torch.nn.Module) -> tuple[list[str], dict[str, int], list[str]]:
    """The float model's linear layers to quantize, its fused experts (name -> number of experts) and the
    layers engines keep in high precision (``lm_head``, routers), found by type and name here, not by the
    library's rules."""
    linears, experts, kept = [], {}, []
    for name, module in model.named_modules():
        fused = {k: p for k, p in module.named_parameters(recurse=False) if p.ndim == 3}
        if isinstance(module, (torch.nn.Linear, Conv1D)):
            is_kept = name == "lm_head" or "router" in name.split(".")[-1] or name.endswith(".mlp.gate")
            (kept if is_kept else linears).append(name)
        elif {"gate_up_proj", "down_proj"} <= fused.keys():
            experts[name] = fused["down_proj"].shape[0]
    return linears, experts, kept


def _calibrated(q) -> bool:
    if not q.spec.needs_amax:  # MX: a scale per block of each tensor, computed as it comes
        return True
    return q.amax is not None and bool(torch.isfinite(q.amax).all()) and bool((q.amax > 0).any())


@contextmanager
def _activations_unquantized(model: torch.nn.Module):
    """The input quantizers off: a dequantized reload computes with dense activations (docs/export.md)."""
    on = [q for name, q in mtq.iter_quantizers(model) if q.is_enabled and "weight_quantizer" not in name]
    for q in on:
        q.disable()
    try:
        yield
    finally:
        for q in on:
            q.enable()


class _Models:
    """Each (architecture, format) quantized once and exported once for the module."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._quantized: dict[tuple[str, str], torch.nn.Module] = {}
        self._exported: dict[tuple[str, str], tuple[torch.nn.Module, Path]] = {}

    def quantized(self, arch: str, fmt: str) -> torch.nn.Module:
        if (arch, fmt) not in self._quantized:
            model = ARCHITECTURES[arch]()
            self._quantized[arch, fmt] = mtq.quantize(model, build_config(fmt, "none"), batches(n=2))
        return self._quantized[arch, fmt]

    def exported(self, arch: str, fmt: str) -> tuple[torch.nn.Module, Path]:
        """(the exported copy of the quantized model, its directory): the export may raise a q/k/v group's
        weight amax to the group's, which changes the copy, not the quantized model."""
        if (arch, fmt) not in self._exported:
            model = copy.deepcopy(self.quantized(arch, fmt))
            directory = self._tmp.mktemp("coverage") / f"{arch}-{fmt}"
            export_hf_checkpoint(model, directory)
            self._exported[arch, fmt] = (model, directory)
        return self._exported[arch, fmt]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> _Models:
    return _Models(tmp_path_factory)


# --------------------------------------------------------------------------------------------- the jobs


@pytest.mark.parametrize(("arch", "fmt"), _params("ptq"))
def test_ptq(models, arch, fmt):
    """Every linear layer and every expert of every fused experts projection gets an enabled, calibrated
    weight quantizer of the format (and an input quantizer where the format quantizes activations); routers
    and ``lm_head`` none; the logits are finite and within the format's bound of the float model's."""
    spec = FORMATS[fmt]
    reference = ARCHITECTURES[arch]()
    linears, experts, kept = _layers(reference)
    assert linears
    model = models.quantized(arch, fmt)
    quantizers = dict(mtq.iter_quantizers(model))
    for name in [*linears, *experts]:
        mine = {n: q for n, q in quantizers.items() if n.startswith(f"{name}.")}
        weights = [q for n, q in mine.items() if "weight_quantizer" in n]
        inputs = [q for n, q in mine.items() if "input_quantizer" in n]
        assert len(weights) == (2 * experts[name] if name in experts else 1), name
        assert all(q.is_enabled and q.num_bits == spec.weight_bits and _calibrated(q) for q in weights), name
        if spec.activations:
            assert inputs, name
            assert all(q.is_enabled and _calibrated(q) for q in inputs), name
        else:
            assert not any(q.is_enabled for q in inputs), name
    for name in kept:
        assert not any(q.is_enabled for n, q in quantizers.items() if n.startswith(f"{name}.")), name
    out, ref = _logits(model), _logits(reference)
    assert torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < spec.max_rel_error, rel


_PACKED = (torch.uint8, torch.int8, torch.float8_e4m3fn)


@pytest.mark.parametrize(("arch", "fmt"), _params("export"))
def test_export(models, arch, fmt, record_property):
    """The checkpoint declares the format and stores every quantized layer packed (fused experts written
    per expert), ``lm_head`` excluded; a combination refused by design raises its documented error."""
    refusal = REFUSED.get((arch, "export", fmt))
    if refusal:
        with pytest.raises(refusal.error, match=refusal.match):
            models.exported(arch, fmt)
        record_property("refused", refusal.reason)
        return
    _, directory = models.exported(arch, fmt)
    quant = hf_quant(directory)["quantization"]
    assert quant["quant_algo"] == FORMATS[fmt].algo
    assert "lm_head" in quant["exclude_modules"]
    stored = tensors(directory)
    linears, experts, _ = _layers(ARCHITECTURES[arch]())
    for name in linears:
        assert stored[f"{name}.weight"].dtype in _PACKED, name
    for name, count in experts.items():
        per_expert = re.compile(rf"{re.escape(name)}\.\d+\.(gate|up|down)_proj\.weight")
        weights = [t for k, t in stored.items() if per_expert.fullmatch(k)]
        assert len(weights) == 3 * count, name
        assert all(t.dtype in _PACKED for t in weights), name


@pytest.mark.parametrize(("arch", "fmt"), _params("reload"))
def test_reload(models, arch, fmt):
    """``from_pretrained`` of the export (dequantized) computes the fake-quant model's logits with its
    activation quantizers off."""
    refusal = REFUSED.get((arch, "export", fmt))
    if refusal:
        pytest.skip("its export is refused")
    model, directory = models.exported(arch, fmt)
    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with _activations_unquantized(model):
        expected = _logits(model)
    torch.testing.assert_close(_logits(loaded), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "fmt"), _params("compress"))
def test_compress(models, arch, fmt):
    """``mtq.compress`` packs every quantized layer and experts projection in the format; dequantizing on the
    fly the logits are the fake-quant model's bit for bit. W8A8 also on torchao's int8 GEMM: a value on a
    rounding boundary may take the neighbouring code and the difference compounds over the layers (measured
    at most 1.4e-3 of the logits' largest magnitude, Phi-3); the bound is 1e-2 of it."""
    pytest.importorskip("torchao", reason="mtq.compress needs the torchao extra")
    from modelopt_lite.quantization.compress import compressed_layers

    model = models.quantized(arch, fmt)
    ref = _logits(model)
    compressed = mtq.compress(copy.deepcopy(model), int8_gemm=False)
    linears, experts, _ = _layers(ARCHITECTURES[arch]())
    expected = {*linears, *(f"{e}.{p}" for e in experts for p in ("gate_up_proj", "down_proj"))}
    layers = compressed_layers(compressed)
    assert set(layers) == expected
    assert set(layers.values()) == {FORMATS[fmt].algo}
    assert torch.equal(_logits(compressed), ref)
    if FORMATS[fmt].algo == "W8A8_SQ_PER_CHANNEL":
        kernel = mtq.compress(copy.deepcopy(model), int8_gemm=True)
        assert (_logits(kernel) - ref).abs().max() <= 1e-2 * ref.abs().max()


@pytest.mark.parametrize("arch", _params("qad", formats=False))
def test_qad(arch, tmp_path):
    """Two QADTrainer steps (NVFP4, the float model of another seed as the teacher): the student is quantized
    before the first step, the losses are finite and positive, and the student's weights move."""
    from modelopt_lite.training import DistillationArguments, QADTrainer, QuantizationArguments

    build = ARCHITECTURES[arch]
    trainer = QADTrainer(
        model=build(),
        args=cpu_args(tmp_path, max_steps=2, per_device_train_batch_size=2),
        train_dataset=CountingData(n=8),
        quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=4),
        distill_args=DistillationArguments(),
        teacher_model=build(seed=1),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = step_losses(trainer)
    assert len(losses) == 2
    assert all(math.isfinite(v) and v > 0 for v in losses), losses
    linears, experts, _ = _layers(build())
    quantizers = dict(mtq.iter_quantizers(trainer.model))
    for name in [*linears, *experts]:
        weights = [q for n, q in quantizers.items() if n.startswith(f"{name}.") and "weight_quantizer" in n]
        assert weights, name
        assert all(q.is_enabled for q in weights), name
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())


# ------------------------------------------------------------------------------------- the page's table


def coverage_table(page: Path = COVERAGE_PAGE) -> tuple[list[str], list[list[str]]]:
    """(header cells, rows of cells) of the table between the coverage markers of ``page``."""
    text = page.read_text(encoding="utf-8")
    assert BEGIN in text, f"{page.name}: no {BEGIN}"
    assert END in text, f"{page.name}: no {END}"
    lines = [ln.strip() for ln in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()]
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) >= 2, f"{page.name}: no table between the markers"

    def cells(line: str) -> list[str]:
        parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        return [p.strip().strip("`").strip() for p in parts]

    return cells(table[0]), [cells(ln) for ln in table[2:]]


def test_the_coverage_page_lists_exactly_these_architectures_and_jobs():
    """docs/coverage.md's table has one row per architecture and one column per job of this file, in order:
    regenerate it (python benchmarks/coverage_table.py) after changing ARCHITECTURES or JOBS."""
    header, rows = coverage_table()
    assert header == ["architecture", *JOBS]
    assert [row[0] for row in rows] == list(ARCHITECTURES)
    assert all(len(row) == len(header) and all(row) for row in rows)


def _generator():
    """benchmarks/coverage_table.py as a module (it imports its sibling ``_harness``)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("coverage_table", REPO / "benchmarks/coverage_table.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return module


def test_the_generator_names_these_jobs_and_renders_outcomes():
    """The real-model data names architectures and jobs of this file; a cell lists what passed, what is
    refused and what fails, with the real model where one was checked."""
    gen = _generator()
    for arch, check in gen.REAL_CHECKS.items():
        assert arch in ARCHITECTURES
        assert set(check["jobs"]) <= set(JOBS), arch
    assert gen.render_cell([{"format": None, "outcome": "pass"}], "real: m") == "pass (tiny + real: m)"
    outcomes = [
        {"format": "fp8", "outcome": "pass"},
        {"format": "int8_sq", "outcome": "refused", "detail": "why"},
        {"format": "mxfp8", "outcome": "refused", "detail": "why"},
        {"format": "nvfp4", "outcome": "fail", "detail": "a | b"},
    ]
    assert gen.render_cell(outcomes) == (
        "pass (tiny): fp8; refused: int8_sq, mxfp8 (why); FAILS: nvfp4 (a \\| b)"
    )
    bug = [{"format": f, "outcome": "xfail", "detail": "bug"} for f in FORMATS]
    assert gen.render_cell(bug, "real: m") == "FAILS (known bug): bug; real: m"
