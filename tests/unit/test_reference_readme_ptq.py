"""The reference README's PTQ + export example (``examples/reference_readme_ptq.py``: only its import lines
changed, placeholders filled with a tiny Llama built in code) runs end to end and writes a checkpoint that
loads back with the quantized model's outputs (issue 15)."""

import json
import runpy
import sys
from pathlib import Path

import torch

import modelopt_lite.quantization as mtq
from modelopt_lite.export import load_hf_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "reference_readme_ptq.py"


def test_reference_readme_ptq_example_runs_and_exports(tmp_path, monkeypatch):
    text = SCRIPT.read_text()
    assert (
        "import modelopt_lite.quantization as mtq  # was: import modelopt.torch.quantization as mtq" in text
    )
    export_dir = tmp_path / "tiny-nvfp4"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), str(export_dir)])
    names = runpy.run_path(str(SCRIPT), run_name="__main__")
    model = names["model"]
    assert sum(q.is_enabled for _, q in mtq.iter_quantizers(model)) == 28
    hf_quant = json.loads((export_dir / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] == "NVFP4"
    assert (
        json.loads((export_dir / "config.json").read_text())["quantization_config"]["quant_method"]
        == "modelopt"
    )
    loaded = load_hf_checkpoint(export_dir, dtype=torch.float32)
    ids = names["calib_set"][0]
    with torch.no_grad():
        # the loaded model has real (dequantized) NVFP4 weights, and its inputs are not fake-quantized
        mtq.disable_quantizer(model, "*input_quantizer")
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-4)
