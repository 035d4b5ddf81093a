"""Calibration in one pass of the data instead of one per decoder layer. AWQ and GPTQ run layer by layer,
with results bit-identical to the one-pass-per-layer algorithm (which the library keeps for models it cannot
run layer by layer, and which these tests force by finding no layers); SmoothQuant takes every layer's
statistics from one pass of the unsmoothed model, equal to the per-layer algorithm up to rounding."""

import copy

import pytest
import torch
from torch import nn

import modelopt_lite.quantization as mtq
from modelopt_lite.quantization.algorithms import smoothquant as smoothquant_mod
from modelopt_lite.quantization.calibration import layerwise as layerwise_mod
from modelopt_lite.quantization.calibration.calibrate import _ALGORITHMS, run_forward_loop
from modelopt_lite.quantization.calibration.max_calib import calibration_mode, max_calibrate
from modelopt_lite.quantization.calibration.targets import blocks, capture, linear_targets

from ._models import VOCAB, batches, tiny_llama, tiny_qwen3_moe

CASES = [
    ("W4A8_AWQ_BETA_CFG", None),  # awq_lite with FP8 activations
    ("NVFP4_AWQ_LITE_CFG", None),
    ("INT4_AWQ_CFG", "awq_clip"),
    ("INT4_AWQ_CFG", "awq_full"),
    ("INT4_AWQ_CFG", "gptq"),
]
COUNTED = [("INT8_SMOOTHQUANT_CFG", None), ("W4A8_AWQ_BETA_CFG", None), ("INT4_AWQ_CFG", "awq_full"),
           ("INT4_AWQ_CFG", "gptq")]  # fmt: skip


def _config(preset, algorithm):
    cfg = copy.deepcopy(getattr(mtq, preset))
    if algorithm is not None:
        cfg["algorithm"] = algorithm
    return cfg


def _padded_batches():
    """Dict batches with a left-padded attention mask (per-batch keyword arguments the layers must see)."""
    out = []
    for i, ids in enumerate(batches(n=3, batch=2, seq=16, seed=3)):
        mask = torch.ones_like(ids)
        mask[1, : 2 + i] = 0
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


class _Counter:
    """Forward calls of the model and of each decoder layer (hooks on the modules themselves, so a layer
    stood in for by a stub is not counted)."""

    def __init__(self, model):
        self.model_calls = 0
        self.layer_calls = [0] * len(model.model.layers)
        self.hooks = [model.register_forward_pre_hook(self._model)]
        for i, layer in enumerate(model.model.layers):
            self.hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._layer(i)))

    def _model(self, module, args):
        self.model_calls += 1

    def _layer(self, i):
        self.layer_calls[i] += 1

    def remove(self):
        for h in self.hooks:
            h.remove()


def _quantize(model, cfg, data, force_per_layer_passes, monkeypatch):
    with monkeypatch.context() as m:
        if force_per_layer_passes:
            m.setattr(layerwise_mod, "decoder_layers", lambda model, targets: None)
        mtq.quantize(model, cfg, data)
    return model


def _logits(model, data):
    with torch.no_grad():
        return torch.cat([model(**b).logits if isinstance(b, dict) else model(b).logits for b in data])


@pytest.mark.parametrize(("preset", "algorithm"), CASES)
def test_layer_by_layer_equals_one_pass_per_layer_bit_for_bit(preset, algorithm, monkeypatch):
    data = _padded_batches()
    reference = tiny_llama(layers=3)
    fast = _quantize(copy.deepcopy(reference), _config(preset, algorithm), data, False, monkeypatch)
    slow = _quantize(copy.deepcopy(reference), _config(preset, algorithm), data, True, monkeypatch)
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state.keys() == slow_state.keys()
    for key in fast_state:
        assert torch.equal(fast_state[key], slow_state[key]), key
    assert torch.equal(_logits(fast, data), _logits(slow, data))


@pytest.mark.parametrize(("preset", "algorithm"), COUNTED)
def test_calibration_runs_the_data_through_the_model_once(preset, algorithm):
    data = batches(n=3, batch=2, seq=16)
    model = tiny_llama(layers=3)
    counter = _Counter(model)
    mtq.quantize(model, _config(preset, algorithm), data)
    counter.remove()
    # one pass of the model (recording the layer inputs; max calibration fused into the layer runs), and
    # each layer at most twice per batch (the first one once more in the recording pass); one pass per
    # layer instead would be 4 passes of the model
    assert counter.model_calls == len(data)
    assert counter.layer_calls[0] <= 3 * len(data)
    assert all(n <= 2 * len(data) for n in counter.layer_calls[1:])


def test_moe_experts_layer_by_layer_equal_one_pass_per_layer(monkeypatch):
    data = batches(n=2, batch=2, seq=16)
    reference = tiny_qwen3_moe()
    cfg = _config("INT4_AWQ_CFG", "awq_full")
    fast = _quantize(copy.deepcopy(reference), copy.deepcopy(cfg), data, False, monkeypatch)
    slow = _quantize(copy.deepcopy(reference), copy.deepcopy(cfg), data, True, monkeypatch)
    for key, value in fast.state_dict().items():
        assert torch.equal(value, slow.state_dict()[key]), key


class _Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, h):
        return h + self.fc(h)


class _Scaled(nn.Module):
    """A stack whose parent changes the hidden state between layers: not reproducible layer by layer."""

    def __init__(self, dim=32, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(_Block(dim) for _ in range(n))

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h) * 0.5
        return h


def test_a_parent_changing_the_hidden_state_between_layers_falls_back_to_one_pass_per_layer(caplog):
    data = batches(n=2, batch=2, seq=8)
    model = _Scaled()
    layers = list(model.layers)
    calls = []
    model.register_forward_pre_hook(lambda m, a: calls.append(1))
    cfg = _config("INT4_AWQ_CFG", None)
    with caplog.at_level("INFO", logger="modelopt_lite"):
        mtq.quantize(model, cfg, data)
    assert list(model.layers) == layers  # the stubs were swapped back
    assert "not layer by layer" in caplog.text
    # the aborted recording pass (one batch), one pass per layer (weights only: max calibration needs none)
    assert len(calls) == 1 + len(data) * len(layers)
    mtq.check_calibrated(model)


def test_generation_with_a_filled_cache_falls_back_to_one_pass_per_layer(monkeypatch, caplog):
    """A forward loop that decodes with the KV cache: the layers read past keys, so no layer-by-layer run."""
    reference = tiny_llama(layers=2)
    prompt = batches(n=1, batch=1, seq=8)[0]

    def loop(model):
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            model(prompt[:, -1:], cache=out.cache, use_cache=True)

    cfg = _config("INT4_AWQ_CFG", None)
    with caplog.at_level("INFO", logger="modelopt_lite"):
        fast = _quantize(copy.deepcopy(reference), copy.deepcopy(cfg), loop, False, monkeypatch)
    assert "filled KV cache" in caplog.text
    slow = _quantize(copy.deepcopy(reference), copy.deepcopy(cfg), loop, True, monkeypatch)
    for key, value in fast.state_dict().items():
        assert torch.equal(value, slow.state_dict()[key]), key


def _smoothquant_one_pass_per_layer(model, forward_loop, alpha=1.0):
    """The algorithm before the single pass: each block's statistics from a pass of the data through the
    model with the blocks before it smoothed, then max calibration of the smoothed model."""
    targets = [
        t for t in linear_targets(model) if t.input_quantizer.is_enabled and t.weight_quantizer.is_enabled
    ]
    for block in blocks(targets):
        with calibration_mode(model), capture(block) as stats:
            run_forward_loop(model, forward_loop)
        smoothquant_mod._smooth(block, stats, alpha)
    max_calibrate(model, forward_loop)


def test_smoothquant_in_one_pass_equals_one_pass_per_layer_up_to_rounding(monkeypatch):
    data = _padded_batches()
    reference = tiny_llama(layers=3)
    cfg = _config("INT8_SMOOTHQUANT_CFG", None)
    counter = _Counter(fast := copy.deepcopy(reference))
    mtq.quantize(fast, copy.deepcopy(cfg), data)
    counter.remove()
    assert counter.model_calls == len(data)
    assert counter.layer_calls == [len(data)] * 3
    slow = copy.deepcopy(reference)
    monkeypatch.setitem(_ALGORITHMS, "smoothquant", _smoothquant_one_pass_per_layer)
    mtq.quantize(slow, copy.deepcopy(cfg), data)
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert fast_state.keys() == slow_state.keys()
    for key in fast_state:  # smoothing scales, weights and amaxes: a few float32 ulps apart at most
        torch.testing.assert_close(fast_state[key], slow_state[key], rtol=1e-5, atol=0, msg=key)
    scales = [k for k in fast_state if k.endswith("_pre_quant_scale")]
    assert len(scales) == 3 * 7
    ids = torch.cat([b["input_ids"] for b in data])
    with torch.no_grad():
        losses = [m(ids, labels=ids).loss for m in (fast, slow, reference)]
    assert abs(losses[0] - losses[1]) < 1e-3 * abs(losses[1] - losses[2]) + 1e-4
