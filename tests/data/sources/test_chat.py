from __future__ import annotations

import json
import pickle
import random

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from lit_seqpack.batch import IGNORE_INDEX  # noqa: E402
from lit_seqpack.data.sources.chat import ChatDataset, ChatSource, has_generation_tags  # noqa: E402
from tests.data._chat_tiny import PLAIN, TAGGED, build_tokenizer, conversation  # noqa: E402

SYSTEM = {"role": "system", "content": "answer with a number"}
ASK_1 = {"role": "user", "content": "what is 2 plus 2"}
SAY_1 = {"role": "assistant", "content": "4"}
ASK_2 = {"role": "user", "content": "thanks"}
SAY_2 = {"role": "assistant", "content": "you are welcome"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _trained(ds: ChatDataset, i: int = 0) -> list[int]:
    labels = ds[i]["labels"]
    return labels[labels != IGNORE_INDEX].tolist()


def test_only_the_assistant_tokens_carry_labels_at_their_exact_positions(tok):
    ds = ChatDataset([[ASK_1, SAY_1]], tok)
    ids, labels = ds[0]["input_ids"].tolist(), ds[0]["labels"].tolist()
    expected = _ids(tok, "<s> <|user|> what is 2 plus 2 <|end|> <|assistant|> 4 <|end|>")
    assert ids == expected
    # positions 0..8 are the BOS, the user turn and the assistant header; 9 and 10 are "4 <|end|>"
    assert len(expected) == 11 and labels == [IGNORE_INDEX] * 9 + expected[9:]
    assert ds.mask_method == "generation" and ds.loss_tokens.tolist() == [2]


def test_multi_turn_with_a_system_prompt_trains_every_assistant_turn(tok):
    ds = ChatDataset([[SYSTEM, ASK_1, SAY_1, ASK_2, SAY_2]], tok)
    ids = ds[0]["input_ids"].tolist()
    assert ids[: len(_ids(tok, "<s> <|system|> answer with a number <|end|>"))] == _ids(
        tok, "<s> <|system|> answer with a number <|end|>"
    )
    assert _trained(ds) == _ids(tok, "4 <|end|> you are welcome <|end|>")
    labels = ds[0]["labels"].tolist()
    header = ids.index(tok.convert_tokens_to_ids("<|assistant|>"))
    assert all(label == IGNORE_INDEX for label in labels[: header + 1])  # system, user and header: no label


def test_last_assistant_and_all(tok):
    conversation_ = [SYSTEM, ASK_1, SAY_1, ASK_2, SAY_2]
    last = ChatDataset([conversation_], tok, train_on="last_assistant")
    assert _trained(last) == _ids(tok, "you are welcome <|end|>")
    every = ChatDataset([conversation_], tok, train_on="all")
    assert every[0]["labels"].tolist() == every[0]["input_ids"].tolist()
    prefix = ChatDataset([conversation_], build_tokenizer(PLAIN), train_on="last_assistant")
    assert prefix.mask_method == "prefix" and prefix[0]["labels"].tolist() == last[0]["labels"].tolist()


def test_generation_mask_and_prefix_fallback_agree_on_a_template_that_supports_both(tok):
    rng = random.Random(1)
    conversations = [conversation(rng) for _ in range(50)]
    tagged = ChatDataset(conversations, tok, mask_method="generation")
    prefix = ChatDataset(conversations, tok, mask_method="prefix")
    assert tagged.mask_method == "generation" and prefix.mask_method == "prefix"
    np.testing.assert_array_equal(tagged.tokens, prefix.tokens)
    np.testing.assert_array_equal(tagged.labels, prefix.labels)
    assert (tagged.labels != IGNORE_INDEX).sum() > 0 and (tagged.labels == IGNORE_INDEX).sum() > 0


def test_template_without_generation_tags_uses_the_prefix_fallback(tok):
    assert has_generation_tags(TAGGED) and not has_generation_tags(PLAIN)
    plain = ChatDataset([[SYSTEM, ASK_1, SAY_1, ASK_2, SAY_2]], build_tokenizer(PLAIN))
    assert plain.mask_method == "prefix"
    assert _trained(plain) == _ids(tok, "4 <|end|> you are welcome <|end|>")
    with pytest.raises(ValueError, match=r"mask_method='generation'.*no \{% generation %\}"):
        ChatDataset([[ASK_1, SAY_1]], build_tokenizer(PLAIN), mask_method="generation")


def test_chat_template_override_as_text_or_file(tmp_path, tok):
    untemplated = build_tokenizer(None)
    with pytest.raises(ValueError, match="no chat template: set chat_template"):
        ChatDataset([[ASK_1, SAY_1]], untemplated)
    from_text = ChatDataset([[ASK_1, SAY_1]], untemplated, chat_template=PLAIN)
    (tmp_path / "chat.jinja").write_text(PLAIN)
    from_file = ChatDataset([[ASK_1, SAY_1]], untemplated, chat_template=str(tmp_path / "chat.jinja"))
    assert from_text[0]["labels"].tolist() == from_file[0]["labels"].tolist()
    assert _trained(from_file) == _ids(tok, "4 <|end|>")
    with pytest.raises(ValueError, match=r"chat_template='missing.jinja' is neither a Jinja template"):
        ChatDataset([[ASK_1, SAY_1]], untemplated, chat_template="missing.jinja")


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_sample(tok):
    # the last message is marked differently, so a shorter rendering is not a prefix of the whole conversation
    unstable = (
        "{% for m in messages %}{% if loop.last %}<|end|> {% endif %}"
        "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    )
    with pytest.raises(ValueError, match=r"conversation 0: .* not a token prefix"):
        ChatDataset([[ASK_1, SAY_1, ASK_2, SAY_2]], tok, chat_template=unstable)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"content": "hi"}], r"conversation 0, message 0: no 'role'"),
        ([{"role": "robot", "content": "hi"}], r"conversation 0, message 0: role='robot'"),
        ([ASK_1, {"role": "assistant", "content": ""}], r"conversation 0, message 1 \(assistant\): 'content'"),
        ([ASK_1, {"role": "assistant"}], r"conversation 0, message 1 \(assistant\): 'content'"),
        ([], r"conversation 0: a conversation must be a non-empty list"),
        ([ASK_1], r"conversation 0: no assistant message"),
    ],
)
def test_bad_conversations_name_the_sample(tok, messages, error):
    with pytest.raises(ValueError, match=error):
        ChatDataset([messages], tok)


def test_jsonl_file_names_the_line_of_a_bad_conversation(tmp_path, tok):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": [ASK_1, SAY_1]}) + "\n\n" + json.dumps({"messages": [{"role": "user"}]}))
    with pytest.raises(ValueError, match=r"chat.jsonl, line 3, message 0 \(user\): 'content'"):
        ChatDataset(str(path), tok)
    path.write_text(json.dumps({"turns": [ASK_1, SAY_1]}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: expected an object with a 'messages' list"):
        ChatDataset(str(path), tok)
    assert len(ChatDataset(str(path), tok, messages_field="turns")) == 1


def test_parquet_and_save_to_disk_folders_with_a_split(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [[ASK_1, SAY_1], [SYSTEM, ASK_2, SAY_2]]
    reference = ChatDataset(rows, tok)
    pq.write_table(pa.table({"messages": rows}), tmp_path / "chat.parquet")
    from_parquet = ChatDataset(str(tmp_path / "chat.parquet"), tok)
    np.testing.assert_array_equal(from_parquet.labels, reference.labels)
    folder = tmp_path / "dd"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"messages": rows}),
            "test": datasets.Dataset.from_dict({"messages": rows[:1]}),
        }
    ).save_to_disk(str(folder))
    assert len(ChatDataset(str(folder), tok, split="train")) == 2
    assert len(ChatDataset(str(folder), tok, split="test")) == 1
    with pytest.raises(
        ValueError, match=r"splits \['test', 'train'\]; split=None is not one: choose one with the source's split"
    ):
        ChatDataset(str(folder), tok)


def test_loaded_from_a_local_folder_pickles_small_and_reports_the_vocabulary(tmp_path, tok):
    tok.save_pretrained(tmp_path / "tok")
    ds = ChatDataset([[ASK_1, SAY_1]], str(tmp_path / "tok"))
    assert ds.vocab_size == len(tok)
    assert len(pickle.dumps(ds)) < 4096  # arrays only, no tokenizer


def test_bad_settings_name_the_setting(tok):
    with pytest.raises(ValueError, match=r"train_on='assistants' must be one of"):
        ChatDataset([[ASK_1, SAY_1]], tok, train_on="assistants")
    with pytest.raises(ValueError, match=r"mask_method='tags' must be one of"):
        ChatDataset([[ASK_1, SAY_1]], tok, mask_method="tags")
    with pytest.raises(ValueError, match=r"format and split only apply to conversations read from a path"):
        ChatDataset([[ASK_1, SAY_1]], tok, split="train")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_bpe():
    """A byte-level BPE tokenizer (GPT-2 style pre-tokenisation, merges learnt on chat text) with ChatML markup."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [f"{m['role']}\n{m['content']}\n" for _ in range(200) for m in conversation(rng)]
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    fast.chat_template = CHATML
    return fast


def test_byte_level_bpe_chatml_trains_exactly_the_assistant_text_by_both_methods():
    tok = _byte_level_bpe()
    rng = random.Random(2)
    conversations = [conversation(rng) for _ in range(30)]
    tagged = ChatDataset(conversations, tok, mask_method="generation")
    prefix = ChatDataset(conversations, tok, mask_method="prefix")
    np.testing.assert_array_equal(tagged.labels, prefix.labels)
    for i, messages in enumerate(conversations):
        trained = tok.decode(_trained(tagged, i))
        assert trained == "".join(f"{m['content']}<|im_end|>\n" for m in messages if m["role"] == "assistant")


def test_long_conversations_go_through_the_overlong_policy_never_cut_silently(tmp_path, tok):
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from tests.data._chat_tiny import write_demo

    folder = write_demo(tmp_path, num_conversations=60)
    settings = {"source": ChatSource(str(folder / "chat.jsonl"), str(folder / "tokenizer"))}
    longest = int(ChatDataset(str(folder / "chat.jsonl"), tok).lengths.max())
    with pytest.raises(ValueError, match=r"samples are longer than max_tokens=24"):
        SeqPackDataModule(**settings, max_tokens=24).setup("fit")
    dm = SeqPackDataModule(**settings, max_tokens=24, overlong="truncate")
    dm.setup("fit")
    assert longest > 24 and dm.overlong_report.num_overlong > 0
    assert int(dm.splits["train"].lengths.max()) == 24
