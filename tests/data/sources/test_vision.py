"""Vision conversations read by ChatSource from a processor folder: lengths, masks, fields and every refusal."""

from __future__ import annotations

import json

import pytest

from tests.data import _vlm_tiny as tiny

FIELDS = {"token_fields": {"mm_token_type_ids": 0}, "sample_fields": ["pixel_values", "image_grid_thw"]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.qwen2_vl_processor(tmp_path_factory.mktemp("vision") / "processor")


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _record(images, entries=None):
    content = [{"type": "image"} for _ in range(len(images) if entries is None else entries)]
    content.append({"type": "text", "text": "what is in the image"})
    answer = [{"type": "text", "text": "a red square"}]
    return {
        "messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
        "images": images,
    }


def _datamodule(source, **settings):
    from lit_seqpack.data.datamodule import SeqPackDataModule

    return SeqPackDataModule(source=source, seed=0, **FIELDS, **settings)


def test_samples_count_their_image_tokens_and_train_only_the_assistant_text(tmp_path, folder):
    from lit_seqpack.data.sources.vision import VisionChatDataset

    tiny.write_png(tmp_path / "img" / "a.png", "red", (48, 32))  # 6 x 4 patches of 8: 24 patches, 6 image tokens
    data = VisionChatDataset(_write(tmp_path / "chat.jsonl", [_record(["img/a.png"]), _record([])]), folder)
    first, second = data[0], data[1]
    assert first["image_grid_thw"].tolist() == [[1, 4, 6]] and first["pixel_values"].shape == (24, 384)
    assert int(first["mm_token_type_ids"].sum()) == 6 and data.lengths[0] == data.lengths[1] + 2 + 6
    assert second["pixel_values"].shape == (0, 384) and second["image_grid_thw"].shape == (0, 3)
    trained = first["input_ids"][first["labels"] != -100]
    assert data.processor.tokenizer.decode(trained) == "a red square <|im_end|>"
    assert data.sample_where(1).endswith("chat.jsonl, line 2")


def test_image_paths_are_relative_to_the_jsonl_file_not_the_working_directory(tmp_path, folder, monkeypatch):
    from lit_seqpack.data.sources.vision import VisionChatDataset

    tiny.write_png(tmp_path / "data" / "img" / "a.png", "blue", (32, 32))
    path = _write(tmp_path / "data" / "chat.jsonl", [_record(["img/a.png"])])
    monkeypatch.chdir(tmp_path)
    assert VisionChatDataset(path, folder)[0]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_a_missing_or_unreadable_image_names_the_file_and_line(tmp_path, folder):
    from lit_seqpack.data.sources.vision import VisionChatDataset

    (tmp_path / "bad.png").write_bytes(b"not a png")
    path = _write(tmp_path / "chat.jsonl", [_record([]), _record(["gone.png"])])
    with pytest.raises(ValueError, match=r"chat\.jsonl, line 2: image 'gone.png' .* cannot be read"):
        VisionChatDataset(path, folder)
    path = _write(tmp_path / "chat.jsonl", [_record(["bad.png"])])
    with pytest.raises(ValueError, match=r"chat\.jsonl, line 1: image 'bad.png' .* cannot be read"):
        VisionChatDataset(path, folder)


@pytest.mark.parametrize("entries", [0, 2])
def test_more_or_fewer_image_entries_than_images_names_the_line(tmp_path, folder, entries):
    from lit_seqpack.data.sources.vision import VisionChatDataset

    tiny.write_png(tmp_path / "a.png", "red", (32, 32))
    path = _write(tmp_path / "chat.jsonl", [_record([]), _record([]), _record(["a.png"], entries=entries)])
    with pytest.raises(ValueError, match=rf"line 3: the messages hold {entries} .* lists 1 images"):
        VisionChatDataset(path, folder)


def test_the_datamodule_must_declare_the_image_fields(tmp_path, folder):
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.data.sources.chat import ChatSource

    source = ChatSource(str(_write(tmp_path / "chat.jsonl", [_record([])])), str(folder))
    with pytest.raises(ValueError, match=r"does not declare, so the images would not reach the model"):
        SeqPackDataModule(source=source, max_tokens=64).setup("fit")


def _long_records(tmp_path):
    tiny.write_png(tmp_path / "big.png", "green", (48, 48))  # 36 patches of 8 merged by 4: 9 image tokens
    return [_record([]), _record(["big.png"]), _record([])]


def test_an_overlong_conversation_is_refused_naming_its_line_under_error_and_truncate(tmp_path, folder):
    from lit_seqpack.data.sources.chat import ChatSource

    source = ChatSource(str(_write(tmp_path / "chat.jsonl", _long_records(tmp_path))), str(folder))
    with pytest.raises(ValueError, match=r"longer than max_tokens=20 .*chat\.jsonl, line 2 is the first"):
        _datamodule(source, max_tokens=20).setup("fit")
    with pytest.raises(ValueError, match=r"chat\.jsonl, line 2: 25 tokens .* cannot cut a conversation with images"):
        _datamodule(source, max_tokens=20, overlong="truncate").setup("fit")


def test_drop_removes_an_overlong_conversation_and_counts_it(tmp_path, folder):
    from lit_seqpack.data.sources.chat import ChatSource

    source = ChatSource(str(_write(tmp_path / "chat.jsonl", _long_records(tmp_path))), str(folder))
    dm = _datamodule(source, max_tokens=20, overlong="drop")
    dm.setup("fit")
    report = dm.pipeline.overlong_report
    assert (report.num_dropped, report.tokens_dropped, report.indices) == (1, 25, (1,))
    batches = list(dm.train_dataloader())
    assert sum(b["num_documents"] for b in batches) == 2
    assert all(p.numel() == 0 for b in batches for p in b["pixel_values"])


def test_vision_conversations_refuse_other_masking_and_text_only_sources_still_refuse_fields(tmp_path, folder):
    from lit_seqpack.data.sources.chat import ChatSource

    path = str(_write(tmp_path / "chat.jsonl", [_record([])]))
    with pytest.raises(ValueError, match=r"train_on='last_assistant'.*vision conversations train every assistant"):
        ChatSource(path, str(folder), train_on="last_assistant")
    assert ChatSource(path, str(folder)).reads_fields


def test_gemma3_style_bidirectional_image_attention_is_refused_by_name():
    from types import SimpleNamespace

    import torch

    from lit_seqpack.model.vlm import multimodal_inputs

    batch = {"pixel_values": [torch.zeros(1, 3, 4, 4)], "input_ids": torch.zeros(1, 4, dtype=torch.long)}
    gemma = SimpleNamespace(config=SimpleNamespace(model_type="gemma3"))
    with pytest.raises(ValueError, match=r"model_type='gemma3'.*refused on image rows: its image tokens attend"):
        multimodal_inputs(gemma, batch, {})
    other = SimpleNamespace(config=SimpleNamespace(model_type="idefics3"))
    with pytest.raises(ValueError, match=r"model_type='idefics3'.*trained for model_type in"):
        multimodal_inputs(other, batch, {})
