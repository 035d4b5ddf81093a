#!/usr/bin/env bash
# Installed-wheel smoke test: build the wheel, install it with only the core dependencies into a clean
# virtualenv, and use it from outside the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
python -m pip wheel -q --no-deps . -w "$work/dist"
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q torch==2.13.0
"$work/venv/bin/pip" install -q "$work"/dist/modelopt_lite-*.whl
cd "$work"
"$work/venv/bin/python" - <<'PY'
import torch
import modelopt_lite
from modelopt_lite.nn import TensorQuantizer

assert modelopt_lite.__file__.startswith("/tmp") or "site-packages" in modelopt_lite.__file__
q = TensorQuantizer("w", num_bits=(2, 1), block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})
w = torch.randn(32, 64)
out = q.calibrate(w)(w)
assert out.shape == w.shape and not torch.equal(out, w)

# the native kernels' C source is in the wheel: they build and answer (bit for bit the reference)
from modelopt_lite.formats import fake_quant_reference, native_call_count, resolve_format
from modelopt_lite.formats.functional import dispatch_fake_quant

spec = resolve_format(num_bits=(4, 3))
before = native_call_count()
assert torch.equal(dispatch_fake_quant(w, spec, w.abs().amax()), fake_quant_reference(w, spec, w.abs().amax()))
wb = w.bfloat16()  # (read and written as bfloat16 by the kernels where their cast equals PyTorch's)
assert torch.equal(dispatch_fake_quant(wb, spec, w.abs().amax()), fake_quant_reference(wb, spec, w.abs().amax()))
from modelopt_lite.formats.kernels import native_build

if native_build.compiler() is not None:  # (without a C compiler the library runs the reference, with a WARNING)
    assert native_call_count() == before + 2, "the native fake-quant kernels did not run from the wheel"

# packaged YAML recipes are in the wheel; quantize -> save -> restore works from the installed package
import tempfile
from transformers import LlamaConfig, LlamaForCausalLM
import modelopt_lite.opt as mto
import modelopt_lite.quantization as mtq

assert "general/ptq/nvfp4_default-kv_fp8" in mtq.list_recipes(), mtq.list_recipes()
cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=64)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 64, (1, 8))
mtq.quantize(model, "general/ptq/nvfp4_default-kv_fp8", [ids])
with tempfile.TemporaryDirectory() as tmp:
    mto.restore(LlamaForCausalLM(cfg).eval(), mto.save(model, tmp + "/q.safetensors"))
    # quantize -> export -> load back with the installed loader
    from transformers import AutoModelForCausalLM
    from modelopt_lite.export import export_hf_checkpoint

    result = export_hf_checkpoint(model, tmp + "/export")
    assert result.quantized_layers, result
    AutoModelForCausalLM.from_pretrained(tmp + "/export")
print(f"wheel smoke test: modelopt_lite {modelopt_lite.__version__} from {modelopt_lite.__file__}: ok")
PY
# every console script answers --help
for script in modelopt-lite-ptq modelopt-lite-default-model modelopt-lite-eval; do
    "$work/venv/bin/$script" --help > /dev/null
done
rm -rf "$work"
