"""QATTrainer (first step): calibration before the loop, gc freeze from step 2 and unfreeze on exit."""

import gc

import torch
from transformers import TrainerCallback, TrainingArguments

from modelopt_lite.nn import QuantModule
from modelopt_lite.quantization import quant_state
from modelopt_lite.training import QATTrainer, QuantizationArguments

from ._models import VOCAB, tiny_llama


class _Data(torch.utils.data.Dataset):
    def __init__(self, n=16, seq=16):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _FreezeCounts(TrainerCallback):
    def __init__(self):
        self.counts = []

    def on_step_end(self, args, state, control, **kwargs):
        self.counts.append(gc.get_freeze_count())


def test_quantizes_before_the_loop_and_manages_the_gc(tmp_path, lib_caplog):
    gc.unfreeze()
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True)  # fmt: skip
    counts = _FreezeCounts()
    trainer = QATTrainer(model=model, args=args, train_dataset=_Data(),
                         quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8),
                         callbacks=[counts])  # fmt: skip
    result = trainer.train()
    assert quant_state(model) is not None
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantModule)
    assert model.model.layers[0].mlp.up_proj.input_quantizer.amax is not None
    assert any("calibrating on 8 sample" in r.getMessage() for r in lib_caplog.records)
    assert counts.counts[0] == 0  # recorded before the GC callback froze after the first optimizer step
    assert all(c > 0 for c in counts.counts[1:])  # frozen from step 2 on
    assert gc.get_freeze_count() == 0  # unfrozen when train() returns
    assert torch.isfinite(torch.tensor(result.training_loss))
