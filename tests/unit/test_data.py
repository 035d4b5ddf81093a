"""``modelopt_lite.data``: one loader through ``datasets`` for calibration, training and evaluation text
(local files of every supported kind, ``save_to_disk`` directories), documents kept whole, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelopt_lite.data import SUPPORTED_SUFFIXES, heldout_split, load_texts, token_stream, windows
from modelopt_lite.training import QATTrainer, QuantizationArguments
from modelopt_lite.training.calib_data import calibration_samples

from ._models import tiny_llama, word_tokenizer
from ._training import cpu_args

DOCS = [" ".join(f"w{(7 * d + i) % 120}" for i in range(10 + 3 * d)) for d in range(6)]  # 10 .. 25 words


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _expected(seq: int) -> torch.Tensor:
    """The calibration windows of ``DOCS``: ``bos doc eos`` joined, cut every ``seq`` tokens."""
    tok = word_tokenizer()
    ids = [t for doc in DOCS for t in [tok.bos_token_id, *tok(doc, add_special_tokens=False).input_ids, 126]]
    count = len(ids) // seq
    return torch.tensor(ids[: count * seq]).view(count, seq)


def _calib(source: Path | str, seq: int = 16, **kw) -> torch.Tensor:
    return torch.stack([s["input_ids"] for s in calibration_samples(source, word_tokenizer(), seq, **kw)])


def test_every_file_kind_and_saved_datasets_give_the_same_documents(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(str(tmp_path / "dict"))
    (tmp_path / "d.json").write_text(json.dumps([{"text": t} for t in DOCS]))
    (tmp_path / "d.txt").write_text("\n\n".join(DOCS) + "\n")
    sources = ["d.parquet", "d.csv", "saved", "dict", "d.json", "d.txt"]
    for name in sources:
        assert [t.strip() for t in load_texts(tmp_path / name)] == DOCS, name
    assert load_texts(tmp_path / "dict", split="test") == DOCS[:1]
    assert load_texts([tmp_path / "d.parquet", tmp_path / "saved"]) == DOCS + DOCS
    # calibration from a parquet file and from a saved dataset: every document, whole, in order
    expected = _expected(16)
    assert torch.equal(_calib(tmp_path / "d.parquet"), expected)
    assert torch.equal(_calib(tmp_path / "saved"), expected)


def test_jsonl_with_a_custom_text_field_through_the_trainer(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(DOCS)))
    quant = QuantizationArguments(
        recipe="FP8_DEFAULT_CFG", calib_dataset=str(path), calib_text_field="body", calib_seq_len=16
    )
    trainer = QATTrainer(
        model=tiny_llama(), args=cpu_args(tmp_path), quant_args=quant, processing_class=word_tokenizer()
    )
    samples = trainer._calibration_source()
    assert torch.equal(torch.stack([s["input_ids"] for s in samples]), _expected(16))
    with pytest.raises(ValueError, match=r"no text field 'text'; its fields: \['id', 'body'\]"):
        _calib(path)


def test_a_document_longer_than_a_window_is_split_not_truncated(tmp_path):
    tok = word_tokenizer()
    long = [" ".join(f"w{(i * 5 + d) % 120}" for i in range(100)) for d in range(2)]  # 102 tokens each
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in long))
    got = _calib(path, seq=16)
    stream = token_stream(tok, long)
    assert stream.numel() == 204
    assert got.shape == (12, 16)  # 204 // 16 windows: only the tail dropped
    assert torch.equal(got.reshape(-1), stream[:192])
    first = [125, *tok(long[0], add_special_tokens=False).input_ids, 126]
    assert got.reshape(-1)[:102].tolist() == first  # the whole first document, across seven windows


def test_bad_input_names_the_source_and_the_choices(tmp_path):
    import datasets

    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(ValueError, match=r"empty.jsonl: empty file"):
        load_texts(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match=r"blank.txt: empty file"):
        load_texts(tmp_path / "blank.txt")
    with pytest.raises(ValueError, match=r"empty.jsonl: empty file"):  # the trainers' calib_dataset too
        _calib(tmp_path / "empty.jsonl")
    with pytest.raises(
        ValueError, match=r"unsupported extension '.xml'; supported: " + ", ".join(SUPPORTED_SUFFIXES)
    ):
        load_texts(tmp_path / "data.xml")
    with pytest.raises(ValueError, match=r"missing\.parquet: no such file"):
        load_texts(tmp_path / "missing.parquet")
    table = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"train": table, "test": table.filter(lambda _: False)}).save_to_disk(
        str(tmp_path / "dict")
    )
    with pytest.raises(ValueError, match=r"split 'test' of .*dict: empty"):
        load_texts(tmp_path / "dict", split="test")
    with pytest.raises(ValueError, match=r"no split 'validation'; its splits: \['test', 'train'\]"):
        load_texts(tmp_path / "dict", split="validation")
    with pytest.raises(ValueError, match="too few to hold out 10"):
        heldout_split(DOCS[:1], 10)
    with pytest.raises(ValueError, match="fewer than one window of 16"):
        windows(torch.arange(15), 16)
    with pytest.raises(ValueError, match=r"calib_dataset='x\.jsonl': no such file"):
        QuantizationArguments(calib_dataset="x.jsonl")


def test_heldout_split_keeps_the_last_documents():
    kept, held = heldout_split([str(i) for i in range(20)], 10)
    assert kept == [str(i) for i in range(18)]
    assert held == ["18", "19"]
