"""The post-training quantization and export example of the reference library's README (``examples/hf_ptq``),
with only the import lines changed. The README's placeholders (the model, the calibration loader) are filled
in with a tiny Llama built from a config and random token batches, so it runs offline on a CPU in seconds.

    python examples/reference_readme_ptq.py [EXPORT_DIR]
"""

import sys

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import modelopt_lite.quantization as mtq  # was: import modelopt.torch.quantization as mtq
from modelopt_lite.export import export_hf_checkpoint  # was: from modelopt.torch.export import ...

# ---- the README's placeholders, filled in
export_dir = sys.argv[1] if len(sys.argv) > 1 else "out/tiny-llama-nvfp4"
calib_size = 8
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def get_dataloader(num_samples):
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, config.vocab_size, (1, 32), generator=generator) for _ in range(num_samples)]


# ---- the README's code, unchanged
# Setup the model
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config)

# Simplified example set up a calibration data loader with the desired calib_size
calib_set = get_dataloader(num_samples=calib_size)


# Prepare the calibration set and define a forward loop
def forward_loop(model):
    for batch in calib_set:
        model(batch)


# PTQ with in-place replacement to quantized modules
model = mtq.quantize(model, mtq.NVFP4_DEFAULT_CFG, forward_loop)

with torch.inference_mode():
    export_hf_checkpoint(
        model,  # The quantized model.
        export_dir,  # The directory where the exported files will be stored.
    )
