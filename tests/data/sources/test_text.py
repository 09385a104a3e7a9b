from __future__ import annotations

import json
import logging
import pickle
import sys

import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from lit_seqpack.data.sources.text import TextDataset, load_tokenizer  # noqa: E402

CORPUS = ["the cat sat", "the dog ran far", "a cat ran", "dog"]


def _tokenizer(*, bos: bool = False, eos_in_template: bool = False, with_eos: bool = True):
    """A tiny word-level tokenizer built locally (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[BOS]", "[EOS]"]))
    if bos or eos_in_template:
        single = " ".join([*(["[BOS]"] if bos else []), "$A", *(["[EOS]"] if eos_in_template else [])])
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[("[BOS]", tok.token_to_id("[BOS]")), ("[EOS]", tok.token_to_id("[EOS]"))]
        )
    kwargs = {"eos_token": "[EOS]"} if with_eos else {}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", **kwargs)


@pytest.fixture(scope="module")
def tok():
    return _tokenizer()


def test_list_of_texts_with_eos(tok):
    ds = TextDataset(CORPUS, tokenizer=tok)
    eos = tok.eos_token_id
    for i, text in enumerate(CORPUS):
        expected = [*tok(text, add_special_tokens=False)["input_ids"], eos]
        assert ds[i]["input_ids"].tolist() == expected
        assert "labels" not in ds[i]
    assert ds.lengths.tolist() == [4, 5, 4, 2]
    assert ds.loss_tokens.tolist() == [3, 4, 3, 1]
    assert TextDataset(CORPUS, tokenizer=tok, add_eos=False).lengths.tolist() == [3, 4, 3, 1]


def test_tokenizer_loaded_from_a_local_path_and_jsonl(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tok")
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(CORPUS)))
    from_path = TextDataset(path, tokenizer=str(tmp_path / "tok"), text_field="body", batch_size=3)
    in_memory = TextDataset(CORPUS, tokenizer=tok)
    assert from_path.source == str(path)
    assert [from_path[i]["input_ids"].tolist() for i in range(4)] == [
        in_memory[i]["input_ids"].tolist() for i in range(4)
    ]
    assert from_path.fingerprint == in_memory.fingerprint  # the content, not the tokenizer object


def test_text_file_one_document_per_line(tmp_path, tok, caplog):
    path = tmp_path / "docs.txt"
    path.write_text("the cat sat\n\n  \ndog\n")
    with caplog.at_level(logging.INFO, logger="lit_seqpack.data.sources.text"):
        ds = TextDataset(path, tokenizer=tok)
    assert len(ds) == 2 and ds.lengths.tolist() == [4, 2]
    assert "skipped 2 blank lines" in caplog.text


def test_special_tokens_follow_the_tokenizer():
    with_bos = _tokenizer(bos=True)
    bos = with_bos.convert_tokens_to_ids("[BOS]")
    ds = TextDataset(["dog"], tokenizer=with_bos)
    assert ds[0]["input_ids"].tolist()[0] == bos and len(ds[0]["input_ids"]) == 3
    assert len(TextDataset(["dog"], tokenizer=with_bos, add_special_tokens=False)[0]["input_ids"]) == 2
    adds_eos = _tokenizer(eos_in_template=True)
    assert TextDataset(["dog"], tokenizer=adds_eos)[0]["input_ids"].tolist().count(adds_eos.eos_token_id) == 1


def test_pickles_without_the_tokenizer(tok):
    ds = TextDataset(CORPUS, tokenizer=tok)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone[1]["input_ids"].tolist() == ds[1]["input_ids"].tolist()
    assert not any(isinstance(v, transformers.PreTrainedTokenizerBase) for v in vars(ds).values())


def test_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="add_eos=True but the tokenizer has no eos_token_id"):
        TextDataset(CORPUS, tokenizer=_tokenizer(with_eos=False))
    with pytest.raises(ValueError, match="document 1: the tokenizer produced no token"):
        TextDataset(["dog", ""], tokenizer=tok, add_eos=False)
    with pytest.raises(ValueError, match=r"texts\[1\] must be a str"):
        TextDataset(["dog", 3], tokenizer=tok)
    with pytest.raises(ValueError, match="texts is empty"):
        TextDataset([], tokenizer=tok)
    with pytest.raises(ValueError, match="is not a file"):
        TextDataset("the cat sat", tokenizer=tok)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        TextDataset(CORPUS, tokenizer=tok, batch_size=0)
    with pytest.raises(TypeError, match="tokenizer must be"):
        load_tokenizer(42)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "dog"}\n{"txt": "cat"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: expected an object with a string field 'text'"):
        TextDataset(bad, tokenizer=tok)
    bad.write_text('{"text": "dog"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: invalid JSON"):
        TextDataset(bad, tokenizer=tok)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no documents"):
        TextDataset(empty, tokenizer=tok)


def test_missing_transformers_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"lit-seqpack\[transformers\]"):
        load_tokenizer(tmp_path)
