"""QADTrainer: teacher handling, chunked loss equal to the unchunked one, KL to the teacher goes down, and
the bad-input list."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modelopt_lite.quantization import quant_state
from modelopt_lite.training import DistillationArguments, QADTrainer, QuantizationArguments
from modelopt_lite.training.distill_loss import chunked_distillation_loss

from ._models import tiny_llama, tiny_qwen3_moe
from ._training import CountingData, cpu_args, step_losses

NVFP4 = QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=8)


def _kl(student, teacher, ids):
    with torch.no_grad():
        s, t = student(ids, output_hidden_states=True), teacher(ids, output_hidden_states=True)
        return chunked_distillation_loss(
            s.hidden_states[-1], t.hidden_states[-1], ids, student.lm_head, teacher.lm_head
        ).item()


def _trained_teacher(tmp_path):
    """A teacher that knows the counting data (a few plain steps), so the student has something to learn."""
    from transformers import Trainer

    teacher = tiny_llama(seed=1)
    Trainer(
        model=teacher,
        args=cpu_args(tmp_path / "teacher", max_steps=60, learning_rate=3e-3, lr_scheduler_type="constant"),
        train_dataset=CountingData(n=64),
    ).train()
    return teacher.eval()


@pytest.mark.slow
def test_qad_lowers_the_kl_to_the_teacher_and_keeps_it_frozen(tmp_path):
    teacher = _trained_teacher(tmp_path)
    before_teacher = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = tiny_llama()
    ids = CountingData(n=8, seed=5).ids
    args = cpu_args(tmp_path, max_steps=30, learning_rate=3e-3, lr_scheduler_type="constant")
    trainer = QADTrainer(
        model=student,
        args=args,
        train_dataset=CountingData(n=64),
        quant_args=NVFP4,
        distill_args=DistillationArguments(distill_chunk_size=7),
        teacher_model=teacher,
    )
    assert not any(p.requires_grad for p in trainer.teacher.parameters())
    trainer.quantize_model()
    kl_before = _kl(student.eval(), teacher, ids)
    trainer.train()
    kl_after = _kl(student.eval(), teacher, ids)
    assert quant_state(student) is not None
    assert kl_after < 0.5 * kl_before, (kl_before, kl_after)
    assert not trainer.teacher.training
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before_teacher.items())
    assert step_losses(trainer)[-1] < step_losses(trainer)[0]


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3_moe])
def test_the_loss_is_the_unchunked_kl_at_temperature_with_ce(tmp_path, make):
    teacher = make(seed=1)
    distill = DistillationArguments(temperature=2.0, ce_loss_weight=0.5, distill_chunk_size=5)
    trainer = QADTrainer(
        model=make(),
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=NVFP4,
        distill_args=distill,
        teacher_model=teacher,
    )
    trainer.quantize_model()
    batch = trainer.data_collator([CountingData()[i] for i in range(3)])
    batch["labels"][0, :4] = -100
    loss = trainer.compute_loss(trainer.model, batch)
    # independent full-logits computation
    logits_s = trainer.model(batch["input_ids"]).logits[:, :-1].float()
    logits_t = teacher(batch["input_ids"]).logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    kl = torch.nn.functional.kl_div(
        torch.log_softmax(logits_s / 2, -1),
        torch.log_softmax(logits_t / 2, -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    ce = torch.nn.functional.cross_entropy(
        logits_s.transpose(1, 2), labels, reduction="none", ignore_index=-100
    )
    expected = ((4 * kl + 0.5 * ce) * mask).sum() / mask.sum()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)


def _reference_kd_loss(student, teacher, batch, temperature):
    """nvidia-modelopt 0.47's ``KDTrainer`` training loss, written out from its definition (not imported):
    full logits of both models from their own forwards, the last position dropped, per token
    ``kl_div(log_softmax(s / T), softmax(t / T), reduction="none").sum(-1) * T^2``, masked by the shifted
    labels, summed and divided by the number of unmasked tokens."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits_s = student(**inputs).logits[..., :-1, :].float()
    with torch.no_grad():
        logits_t = teacher(**inputs).logits[..., :-1, :].float()
    per_token = torch.nn.functional.kl_div(
        torch.log_softmax(logits_s / temperature, dim=-1),
        torch.softmax(logits_t / temperature, dim=-1),
        reduction="none",
    ).sum(dim=-1)
    per_token *= temperature**2
    mask = batch["labels"][..., 1:] != -100
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("num_items", [False, True])
def test_the_default_loss_is_the_references_bit_for_bit(tmp_path, temperature, num_items):
    """The default recipe's arithmetic is the reference's: the same loss and the same gradient of every
    parameter to the last bit (a rounding difference alone parts two quantized training runs)."""
    teacher = tiny_llama(seed=1)
    trainer = QADTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=NVFP4,
        distill_args=DistillationArguments(temperature=temperature),
        teacher_model=teacher,
    )
    trainer.quantize_model()
    model = trainer.model.train()
    batch = trainer.data_collator([CountingData()[i] for i in range(3)])
    batch["labels"][0, :4] = -100
    count = (batch["labels"][:, 1:] != -100).sum() if num_items else None  # what Trainer passes

    def loss_and_grads(compute):
        model.zero_grad(set_to_none=True)
        loss = compute()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, our_grads = loss_and_grads(lambda: trainer.compute_loss(model, batch, num_items_in_batch=count))
    ref, ref_grads = loss_and_grads(lambda: _reference_kd_loss(model, teacher, batch, temperature))
    assert torch.equal(ours, ref), (ours.item(), ref.item())
    assert our_grads.keys() == ref_grads.keys()
    assert len(ref_grads) > 0
    unequal = [n for n in ref_grads if not torch.equal(our_grads[n], ref_grads[n])]
    assert not unequal, unequal


def test_teacher_from_a_path_in_the_students_dtype(tmp_path):
    tiny_llama(seed=1).save_pretrained(tmp_path / "teacher")
    student = tiny_llama().to(torch.bfloat16)
    trainer = QADTrainer(
        model=student,
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=NVFP4,
        distill_args=DistillationArguments(teacher_model=str(tmp_path / "teacher")),
    )
    assert next(trainer.teacher.parameters()).dtype == torch.bfloat16
    assert not trainer.teacher.training
    trainer.train()
    assert torch.isfinite(torch.tensor(step_losses(trainer))).all()


def test_bad_teachers_are_refused_before_training(tmp_path):
    other_vocab = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=200
        )
    )
    common = dict(model=tiny_llama(), args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=NVFP4)
    with pytest.raises(ValueError, match=r"vocabulary \(200\) differs from the student's \(128\)"):
        QADTrainer(**common, teacher_model=other_vocab)
    with pytest.raises(ValueError, match="is not a directory"):
        QADTrainer(**common, distill_args=DistillationArguments(teacher_model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="needs a teacher"):
        QADTrainer(**common)


def test_a_teacher_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    from ._models import word_tokenizer

    teacher_dir = tmp_path / "teacher"
    tiny_llama(seed=1).save_pretrained(teacher_dir)
    student_tok = word_tokenizer()
    shuffled = word_tokenizer()
    shuffled.backend_tokenizer.model = type(shuffled.backend_tokenizer.model)(
        {**student_tok.get_vocab(), "w1": 2, "w2": 1}, unk_token="w0"
    )
    shuffled.save_pretrained(teacher_dir)
    common = dict(model=tiny_llama(), args=cpu_args(tmp_path), train_dataset=CountingData(), quant_args=NVFP4)
    distill = DistillationArguments(teacher_model=str(teacher_dir))
    with pytest.raises(ValueError, match=r"tokenizer \(128 tokens, from .*teacher\) differs .*'w1' is id 2"):
        QADTrainer(**common, distill_args=distill, processing_class=student_tok)
    student_tok.save_pretrained(teacher_dir)  # the same tokenizer: accepted
    QADTrainer(**common, distill_args=distill, processing_class=student_tok)


def test_resuming_qad_with_another_quantization_config_is_refused(tmp_path):
    teacher = tiny_llama(seed=1)
    common = dict(train_dataset=CountingData(), distill_args=DistillationArguments(), teacher_model=teacher)
    args = cpu_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    QADTrainer(model=tiny_llama(), args=args, quant_args=NVFP4, **common).train()
    other = QuantizationArguments(recipe="FP8_DEFAULT_CFG", calib_size=8)
    trainer = QADTrainer(model=tiny_llama(), args=args, quant_args=other, **common)
    with pytest.raises(ValueError, match="quantization configs differ at"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
