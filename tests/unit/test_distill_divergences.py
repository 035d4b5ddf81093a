"""The distillation divergences other than the default (reverse KL, generalized JSD, top-k KL): each equals
its textbook formula written out here in plain probabilities (not the library's expressions), whole batch
and chunked alike, with temperature and ``-100`` labels; bad options raise at argument construction."""

import pytest
import torch
from torch import nn

from modelopt_lite.training import DistillationArguments
from modelopt_lite.training.distill_loss import chunked_distillation_loss

T_VALUES = (1.0, 2.5)


def _probs(logits, temperature):
    z = logits.double() / temperature
    e = (z - z.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


def _kl(a, b):  # sum_v a_v log(a_v / b_v), with 0 log 0 = 0
    return torch.where(a > 0, a * (a / b).log(), torch.zeros_like(a)).sum(-1)


def _expected(loss, ls, lt, labels, temperature, beta=0.5, top_k=3):
    """Per-token divergence times T^2, masked mean over the shifted labels (float64)."""
    ls, lt, lab = ls[:, :-1], lt[:, :-1], labels[:, 1:]
    if loss == "top_k_kl":
        idx = lt.topk(top_k, dim=-1).indices
        ls, lt = ls.gather(-1, idx), lt.gather(-1, idx)  # renormalized: the softmax over the k tokens
    p, q = _probs(lt, temperature), _probs(ls, temperature)
    if loss in ("forward_kl", "top_k_kl"):
        d = _kl(p, q)
    elif loss == "reverse_kl":
        d = _kl(q, p)
    else:
        m = beta * p + (1 - beta) * q
        d = beta * _kl(p, m) + (1 - beta) * _kl(q, m)
    mask = lab != -100
    return (d * temperature**2 * mask).sum() / mask.sum()


def _setup(vocab=40):
    torch.manual_seed(0)
    logits_s = (3 * torch.randn(2, 7, vocab)).requires_grad_(True)
    logits_t = 3 * torch.randn(2, 7, vocab)
    labels = torch.randint(0, vocab, (2, 7))
    labels[0, :3] = -100
    labels[1, -2] = -100
    return logits_s, logits_t, labels


CASES = [
    ("reverse_kl", {}),
    ("jsd", {"beta": 0.5}),
    ("jsd", {"beta": 0.1}),
    ("jsd", {"beta": 0.9}),
    ("top_k_kl", {"top_k": 3}),
    ("top_k_kl", {"top_k": 2}),
]


@pytest.mark.parametrize("temperature", T_VALUES)
@pytest.mark.parametrize(("loss", "opts"), CASES)
@pytest.mark.parametrize("chunk_size", [None, 1, 4])
def test_divergence_equals_its_formula(loss, opts, temperature, chunk_size):
    ls, lt, labels = _setup()
    expected = _expected(loss, ls, lt, labels, temperature, **opts).float()
    got = chunked_distillation_loss(
        ls, lt, labels, nn.Identity(), nn.Identity(), temperature, chunk_size=chunk_size, loss=loss, **opts
    )
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)
    assert got > 0


@pytest.mark.parametrize(("loss", "opts"), CASES)
def test_chunked_equals_whole_value_and_gradients(loss, opts):
    torch.manual_seed(1)
    hs, ht = torch.randn(2, 9, 16, requires_grad=True), torch.randn(2, 9, 16)
    head_s, head_t = nn.Linear(16, 50), nn.Linear(16, 50)
    labels = torch.randint(0, 50, (2, 9))
    labels[1, :4] = -100
    results = []
    for chunk in (None, 5):
        value = chunked_distillation_loss(
            hs, ht, labels, head_s, head_t, 2.0, 1.0, 0.3, chunk, loss=loss, **opts
        )
        results.append((value, torch.autograd.grad(value, [hs, head_s.weight])))
    (whole, g_whole), (chunked, g_chunked) = results
    assert torch.allclose(whole, chunked, rtol=1e-5, atol=1e-7)
    for a, b in zip(g_whole, g_chunked, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_gradient_matches_the_formula():
    ls, lt, labels = _setup()
    leaf, ident = ls.detach().double().requires_grad_(True), nn.Identity()
    for loss, opts in CASES:
        value = chunked_distillation_loss(ls, lt, labels, ident, ident, 2.0, loss=loss, **opts)
        g = torch.autograd.grad(value, ls)[0]
        g_ref = torch.autograd.grad(_expected(loss, leaf, lt, labels, 2.0, **opts), leaf)[0]
        assert torch.allclose(g.double(), g_ref, rtol=1e-4, atol=1e-7), loss


def test_ends_of_beta_and_a_large_k_are_the_kl_divergences():
    ls, lt, labels = _setup()

    def run(**kw):
        return chunked_distillation_loss(ls, lt, labels, nn.Identity(), nn.Identity(), 1.5, **kw)

    forward = run()  # the default
    assert torch.equal(run(loss="jsd", beta=0.0), forward)
    assert torch.equal(run(loss="forward_kl", beta=0.3, top_k=2), forward)  # options of other losses unused
    assert torch.allclose(run(loss="top_k_kl", top_k=1000), forward, rtol=1e-5)
    assert torch.allclose(run(loss="jsd", beta=1.0), run(loss="reverse_kl"), rtol=0, atol=0)
    assert not torch.allclose(run(loss="reverse_kl"), forward, rtol=1e-3)
    # symmetric JSD is bounded by T^2 log 2 and is symmetric in the two distributions
    jsd = run(loss="jsd", beta=0.5)
    swapped = chunked_distillation_loss(
        lt.clone().requires_grad_(True), ls.detach(), labels, nn.Identity(), nn.Identity(), 1.5, loss="jsd"
    )
    assert 0 < jsd < 1.5**2 * torch.log(torch.tensor(2.0))
    assert torch.allclose(jsd, swapped, rtol=1e-5)


def test_identical_models_give_zero_for_every_divergence():
    ls, _, labels = _setup()
    ident = nn.Identity()
    for loss, opts in CASES:
        same = ls.detach()
        got = chunked_distillation_loss(ls, same, labels, ident, ident, 2.0, loss=loss, **opts)
        assert got.abs() < 1e-6, loss


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"distill_loss": "kl_rev"}, "distill_loss='kl_rev' is unknown .*reverse_kl"),
        ({"distill_loss": "jsd", "jsd_beta": 1.5}, r"jsd_beta=1.5 must be a number in \[0, 1\]"),
        ({"jsd_beta": -0.1}, r"jsd_beta=-0.1"),
        ({"distill_loss": "top_k_kl", "distill_top_k": 0}, "distill_top_k=0 must be an integer >= 2"),
        ({"distill_top_k": 1}, "distill_top_k=1 .*always zero"),
    ],
)
def test_bad_options_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillationArguments(**kwargs)


def test_arguments_reach_the_loss():
    args = DistillationArguments(distill_loss="jsd", jsd_beta=0.25, distill_top_k=7)
    assert (args.distill_loss, args.jsd_beta, args.distill_top_k) == ("jsd", 0.25, 7)
    with pytest.raises(ValueError, match="distill_loss='nope'"):
        chunked_distillation_loss(*_setup(), nn.Identity(), nn.Identity(), loss="nope")


def test_the_command_line_and_yaml_set_the_loss(tmp_path):
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((TrainingArguments, DistillationArguments))
    _, distill = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--distill_loss", "jsd", "--jsd_beta", "0.3", "--distill_top_k", "9"]
    )
    assert (distill.distill_loss, distill.jsd_beta, distill.distill_top_k) == ("jsd", 0.3, 9)
    (tmp_path / "a.yaml").write_text(f"output_dir: {tmp_path}\ndistill_loss: top_k_kl\ndistill_top_k: 16\n")
    _, distill = parser.parse_yaml_file(str(tmp_path / "a.yaml"))
    assert (distill.distill_loss, distill.distill_top_k) == ("top_k_kl", 16)


def test_the_trainer_uses_the_chosen_divergence(tmp_path):
    from modelopt_lite.training import QADTrainer, QuantizationArguments

    from ._models import tiny_llama
    from ._training import CountingData, cpu_args

    teacher = tiny_llama(seed=1)
    trainer = QADTrainer(
        model=tiny_llama(),
        args=cpu_args(tmp_path),
        train_dataset=CountingData(),
        quant_args=QuantizationArguments(recipe="NVFP4_DEFAULT_CFG", calib_size=4),
        distill_args=DistillationArguments(temperature=2.0, distill_loss="reverse_kl", distill_chunk_size=5),
        teacher_model=teacher,
    )
    trainer.quantize_model()
    batch = trainer.data_collator([CountingData()[i] for i in range(2)])
    batch["labels"][0, :4] = -100
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        ls, lt = trainer.model(batch["input_ids"]).logits, teacher(batch["input_ids"]).logits
    expected = _expected("reverse_kl", ls, lt, batch["labels"], 2.0).float()
    assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(loss, _expected("forward_kl", ls, lt, batch["labels"], 2.0).float(), rtol=1e-3)
