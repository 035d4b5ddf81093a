"""QuantizationArguments / DistillationArguments parse with HfArgumentParser and refuse bad values."""

import pytest
from transformers import HfArgumentParser, TrainingArguments

from modelopt_lite.training import DistillationArguments, QuantizationArguments


def test_parsed_next_to_training_arguments(tmp_path):
    parser = HfArgumentParser((TrainingArguments, QuantizationArguments, DistillationArguments))
    training, quant, distill = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--recipe", "general/qad/nvfp4-kv_fp8", "--calib_size", "64",
         "--experts_implementation", "grouped_mm", "--gc_refreeze_every", "50", "--temperature", "2.0",
         "--ce_loss_weight", "0.5", "--manual_gc", "false"]
    )  # fmt: skip
    assert training.output_dir == str(tmp_path)
    assert (quant.recipe, quant.calib_size, quant.experts_implementation) == (
        "general/qad/nvfp4-kv_fp8",
        64,
        "grouped_mm",
    )
    assert quant.gc_refreeze_every == 50
    assert quant.manual_gc is False
    assert (distill.temperature, distill.ce_loss_weight) == (2.0, 0.5)
    yaml_file = tmp_path / "args.yaml"
    yaml_file.write_text(f"output_dir: {tmp_path}\nrecipe: NVFP4_DEFAULT_CFG\ncalib_size: 8\n")
    _, quant, _ = parser.parse_yaml_file(str(yaml_file))
    assert quant.recipe == "NVFP4_DEFAULT_CFG"


@pytest.mark.parametrize(
    ("cls", "kwargs", "match"),
    [
        (QuantizationArguments, {"recipe": "general/qat/nvfp5"}, "unknown preset or recipe"),
        (QuantizationArguments, {"calib_size": 0}, "calib_size"),
        (QuantizationArguments, {"experts_implementation": "batched_mm"}, "experts_implementation"),
        (QuantizationArguments, {"gc_refreeze_every": 0}, "gc_refreeze_every"),
        (DistillationArguments, {"temperature": 0.0}, "temperature"),
        (DistillationArguments, {"kd_loss_weight": 0.0, "ce_loss_weight": 0.0}, "not both 0"),
    ],
)
def test_bad_values_raise(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)
