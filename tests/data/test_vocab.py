"""The data's vocabulary comes from the tokenizer when there is one, and vocabulary errors name the right setting."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lit_seqpack.cli import check_vocab
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources import ChatSource, TextSource, TokenizedSource
from lit_seqpack.data.sources.base import resolve_source
from lit_seqpack.data.sources.text import tokenizer_vocab_size, vocab_hint


class _Sized(torch.nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.hparams = {"vocab_size": vocab_size}


def test_tokenizer_vocab_size_counts_added_tokens_and_larger_ids():
    assert tokenizer_vocab_size(list(range(10)), np.array([3, 4])) == 10
    assert tokenizer_vocab_size(list(range(10)), np.array([3, 12])) == 13
    assert tokenizer_vocab_size(lambda text: text, np.array([3, 12])) == 13  # no len(): the data decides


@pytest.mark.parametrize(
    ("make", "named", "not_named"),
    [
        (lambda tok: resolve_source("synthetic"), "SyntheticInstructionDataset source (data.source.init_args", "path"),
        (lambda tok: TokenizedSource("train.jsonl"), "'train.jsonl' (TokenizedSource)", "synthetic"),
        (lambda tok: ChatSource("c.jsonl", tok), "the tokenizer '{tok}' of the ChatSource source", "synthetic"),
        (lambda tok: TextSource("t.txt", tok), "the tokenizer '{tok}' of the TextSource source", "synthetic"),
    ],
)
def test_the_vocabulary_error_names_the_setting_of_the_source(tmp_path, make, named, not_named):
    with pytest.raises(ValueError, match="smaller than the data's vocab_size=100") as error:
        check_vocab(_Sized(50), 100, hint=vocab_hint(make(str(tmp_path))))
    assert named.format(tok=tmp_path) in str(error.value) and not_named not in str(error.value)


def test_a_jsonl_datamodule_is_not_told_to_lower_the_synthetic_vocabulary(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 99]}) + "\n")
    dm = SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"))
    with pytest.raises(ValueError, match=r"data at .*train.jsonl' \(TokenizedSource\)") as error:
        check_vocab(_Sized(50), dm.vocab_size, hint=vocab_hint(dm.source))
    assert "synthetic" not in str(error.value)


def test_text_and_chat_data_take_the_tokenizers_vocabulary(tmp_path):
    pytest.importorskip("transformers")
    from tests.data._chat_tiny import build_tokenizer, write_demo

    folder = write_demo(tmp_path, num_conversations=8)
    tok = build_tokenizer()
    chat = SeqPackDataModule(source=ChatSource(str(folder / "chat.jsonl"), str(folder / "tokenizer")))
    assert chat.vocab_size == len(tok) > chat.pipeline.scan().max_id + 1  # the tokenizer's, not the largest id seen + 1
    (tmp_path / "docs.txt").write_text("what is 2 plus 2\n4\n")
    text = SeqPackDataModule(source=TextSource(str(tmp_path / "docs.txt"), str(folder / "tokenizer")))
    assert text.vocab_size == len(tok)
