"""Vision-language models trained packed and padded against the stock model run one conversation at a time.

Tiny Qwen2-VL (2 text layers of width 64 with mRoPE sections, a 1-layer vision tower with patch 8), Qwen2.5-VL (a
windowed and a full vision block) and LLaVA (a 2-layer CLIP tower), built from configs; 16 TRL-format conversations
with 0-2 PNGs each, read by ``ChatSource`` from a processor folder. The step loss (all conversations in one
optimizer step) must equal the stock eager model's token mean over the assistant tokens, computed per conversation,
and so must one language-model and one vision-tower gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.data import _vlm_tiny as tiny

FIELDS = {"token_fields": {"mm_token_type_ids": 0}, "sample_fields": ["pixel_values", "image_grid_thw"]}


def _folder(tmp_path, kind):
    if kind == "llava":
        return tiny.llava_processor(tmp_path / "processor")
    return tiny.qwen2_vl_processor(
        tmp_path / "processor", "Qwen2_5_VLProcessor" if kind == "qwen2_5_vl" else "Qwen2VLProcessor"
    )


def _config(kind, processor):
    if kind != "llava":
        return tiny.qwen2_vl_config(processor, kind)
    return tiny.llava_config(processor)


def _setup(tmp_path, kind, count=16, **model_kwargs):
    from lit_seqpack.data.sources.chat import ChatSource
    from lit_seqpack.data.sources.vision import VisionProcessor
    from lit_seqpack.model.lm import HFCausalLM

    folder = _folder(tmp_path, kind)
    path = tiny.write_conversations(tmp_path / "data", count)
    torch.manual_seed(0)
    model = HFCausalLM(config=_config(kind, VisionProcessor(folder)), lr=1e-3, **model_kwargs)
    return ChatSource(str(path), str(folder)), model


def _fields(kind):
    if kind == "llava":
        return {"token_fields": {"mm_token_type_ids": 0}, "sample_fields": ["pixel_values"]}
    return FIELDS


def _stock(model):
    """The stock transformers model with the same weights and eager attention."""
    from transformers import AutoModelForImageTextToText

    config = copy.deepcopy(model.model.config)
    stock = AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    stock.load_state_dict(model.model.state_dict())
    return stock.train()


def _stock_logits(stock, sample, kind):
    """The stock model's logits ``[L, V]`` of one conversation run alone, with its images."""
    kwargs = {}
    if len(sample["pixel_values"]):
        kwargs["pixel_values"] = sample["pixel_values"]
        if kind != "llava":
            kwargs["image_grid_thw"] = sample["image_grid_thw"]
    if kind != "llava":
        kwargs["mm_token_type_ids"] = sample["mm_token_type_ids"][None]
    return stock(input_ids=sample["input_ids"][None], use_cache=False, **kwargs).logits[0]


def _reference(stock, dataset, kind, indices=None):
    """Token-mean loss over every conversation's (or ``indices``') assistant tokens, one conversation a forward."""
    total, count = 0.0, 0
    for i in range(len(dataset)) if indices is None else indices:
        sample = dataset[i]
        logits = _stock_logits(stock, sample, kind)[:-1]
        targets = sample["labels"][1:]
        total = total + F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
    return total / count


def _grads(module, names):
    params = dict(module.named_parameters())
    return {n: params[n].grad.detach().clone() for n in names}


def _names(model, kind):
    params = [n for n, _ in model.named_parameters()]
    language = next(n for n in params if "language_model" in n and "q_proj.weight" in n)
    vision = next(
        n
        for n in params
        if ("visual" in n or "vision_tower" in n) and n.endswith("weight") and ("qkv" in n or "q_proj" in n)
    )
    return [language, vision]


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "llava"])
@pytest.mark.parametrize("mode", ["packing", "padded"])
def test_step_loss_and_gradients_equal_the_stock_model_per_conversation(tmp_path, kind, mode):
    from lit_seqpack.data.datamodule import SeqPackDataModule

    source, model = _setup(tmp_path, kind)
    budget = {"max_tokens": 1024} if mode == "packing" else {"batch_size": 16}
    dm = SeqPackDataModule(source=source, mode=mode, seed=0, **budget, **_fields(kind))
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 1 and batches[0]["num_documents"] == 16
    batch = batches[0]
    assert sum(int(p.shape[0] > 0) for p in batch["pixel_values"]) >= 8  # images in most conversations
    stock = _stock(model)
    names = _names(stock, kind)

    model.model.train()
    loss = model.training_step(batch, 0)
    loss.backward()
    expected = _reference(stock, dm.pipeline.dataset, kind)
    expected.backward()

    assert abs(loss.item() - expected.item()) <= 1e-4 * max(1.0, abs(expected.item()))
    ours, theirs = _grads(model.model, names), _grads(stock, names)
    for name in names:
        error = (ours[name] - theirs[name]).norm() / theirs[name].norm()
        assert theirs[name].norm() > 0 and error <= 1e-4, (name, float(error))


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_idle_vision_outputs_leave_the_text_exact_and_reach_the_vision_parameters_an_image_reaches(tmp_path, kind):
    """A text-only conversation given the idle tower's outputs: the stock model's logits are bitwise those without,
    and the vision parameters that a conversation with an image trains (LLaVA: not the CLIP layers after the
    selected feature layer) get gradients of zeros, as DDP's reducer needs."""
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.model.vlm import idle_vision_outputs, vision_parameters

    source, model = _setup(tmp_path, kind)
    dm = SeqPackDataModule(source=source, mode="padded", batch_size=16, **_fields(kind))
    dm.setup("fit")
    stock = _stock(model)
    names = {id(p): n for n, p in stock.named_parameters()}
    vision = vision_parameters(stock)
    assert {names[id(p)].split(".")[1] for p in vision} == (
        {"vision_tower", "multi_modal_projector"} if kind == "llava" else {"visual"}
    )
    _reference(stock, dm.pipeline.dataset, kind, indices=[1]).backward()  # conversation 1 has an image
    trained = {names[id(p)] for p in vision if p.grad is not None and p.grad.any()}
    stock.zero_grad(set_to_none=True)

    sample = dm.pipeline.dataset[0]  # conversation 0 has none
    assert not len(sample["pixel_values"])
    kwargs = {} if kind == "llava" else {"mm_token_type_ids": sample["mm_token_type_ids"][None]}
    ids = sample["input_ids"][None]
    plain = stock(input_ids=ids, use_cache=False, **kwargs).logits
    idle = {"image": idle_vision_outputs(stock)}
    logits = stock(input_ids=ids, use_cache=False, mm_encoder_outputs=idle, **kwargs).logits
    assert torch.equal(plain, logits)
    logits.sum().backward()
    reached = {names[id(p)] for p in vision if p.grad is not None}
    assert trained and reached == trained
    assert not any(p.grad.any() for p in vision if p.grad is not None)
    assert stock.lm_head.weight.grad.any()


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava"])
def test_predict_scores_each_conversation_as_the_stock_model_alone(tmp_path, kind):
    """``trainer.predict`` on packed rows with images: every conversation once, in order, its token log-probs and
    its assistant tokens' nll those of the stock eager model run on it alone."""
    from lightning.pytorch import Trainer

    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.prediction import predictions_in_order

    source, model = _setup(tmp_path, kind)
    dm = SeqPackDataModule(source=source, mode="packing", max_tokens=512, **_fields(kind))
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    records = predictions_in_order(trainer.predict(model, datamodule=dm))
    dataset, stock = dm.pipeline.dataset, _stock(model).eval()
    assert [r["index"] for r in records] == list(range(16))
    for record in records:
        sample = dataset[record["index"]]
        with torch.no_grad():
            logprobs = _stock_logits(stock, sample, kind)[:-1].float().log_softmax(-1)
        ids, labels = sample["input_ids"], sample["labels"][1:]
        torch.testing.assert_close(
            record["token_logprobs"], logprobs.gather(-1, ids[1:, None])[:, 0], atol=1e-5, rtol=0
        )
        kept = labels != -100
        assert record["nll"] == pytest.approx(-logprobs[kept].gather(-1, labels[kept, None]).sum().item(), abs=1e-4)
