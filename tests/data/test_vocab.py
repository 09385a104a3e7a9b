"""The data's vocabulary comes from the tokenizer when there is one, and vocabulary errors name the right setting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lit_seqpack.cli import check_vocab
from lit_seqpack.data._vocab import tokenizer_vocab_size, vocab_hint
from lit_seqpack.data.datamodule import SeqPackDataModule


class _Sized(torch.nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.hparams = {"vocab_size": vocab_size}


def test_tokenizer_vocab_size_counts_added_tokens_and_larger_ids():
    assert tokenizer_vocab_size(list(range(10)), np.array([3, 4])) == 10
    assert tokenizer_vocab_size(list(range(10)), np.array([3, 12])) == 13
    assert tokenizer_vocab_size(lambda text: text, np.array([3, 12])) == 13  # no len(): the data decides


@pytest.mark.parametrize(
    ("settings", "named", "not_named"),
    [
        ({"source": "synthetic"}, "data.synthetic.vocab_size", "data.path"),
        ({"source": "jsonl", "path": "train.jsonl"}, "data.path='train.jsonl'", "synthetic"),
        ({"source": "chat", "path": "c.jsonl", "tokenizer": "tok"}, "data.tokenizer='tok'", "synthetic"),
        ({"source": "text", "path": "t.txt", "tokenizer": "tok"}, "data.tokenizer='tok'", "synthetic"),
    ],
)
def test_the_vocabulary_error_names_the_setting_of_the_source(settings, named, not_named):
    with pytest.raises(ValueError, match="smaller than the data's vocab_size=100") as error:
        check_vocab(_Sized(50), 100, hint=vocab_hint(settings))
    assert named in str(error.value) and not_named not in str(error.value)


def test_a_jsonl_datamodule_is_not_told_to_lower_the_synthetic_vocabulary(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 99]}) + "\n")
    dm = SeqPackDataModule(source="jsonl", path=str(path))
    with pytest.raises(ValueError, match=r"data.path=.*train.jsonl") as error:
        check_vocab(_Sized(50), dm.vocab_size, hint=vocab_hint(dm.hparams))
    assert "synthetic" not in str(error.value)


def test_text_and_chat_data_take_the_tokenizers_vocabulary(tmp_path):
    pytest.importorskip("transformers")
    from tests.data._chat_tiny import build_tokenizer, write_demo

    folder = write_demo(tmp_path, num_conversations=8)
    tok = build_tokenizer()
    chat = SeqPackDataModule(source="chat", path=str(folder / "chat.jsonl"), tokenizer=str(folder / "tokenizer"))
    assert chat.vocab_size == len(tok) > chat._scan().max_id + 1  # the tokenizer's, not the largest id seen + 1
    (tmp_path / "docs.txt").write_text("what is 2 plus 2\n4\n")
    text = SeqPackDataModule(source="text", path=str(tmp_path / "docs.txt"), tokenizer=str(folder / "tokenizer"))
    assert text.vocab_size == len(tok)
