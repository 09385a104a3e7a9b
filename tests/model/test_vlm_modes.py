"""Vision-language models in mode ``dynamic``, over gradient accumulation and 2 DDP ranks, and the leak probe.

The tiny Qwen2-VL / Qwen2.5-VL / LLaVA models and the 16 conversations of ``tests/model/test_vlm.py`` (which checks
``packing`` and ``padded``). ``dynamic`` (length-sorted padded rows under a token budget) must give the stock eager
model's per-conversation token-mean loss and its gradients too. Over accumulation (2 microbatches) and over 2 gloo
ranks through Lightning's DDP (2 x 2 microbatches), the step's gradient must equal the gradient of one big batch of
the same conversations with a token-mean loss (the stock model run per conversation, summed, over the step's assistant
tokens); the microbatches carry unequal numbers of loss tokens, so a per-microbatch mean would be measurably off.
"""

from __future__ import annotations

import pytest

from tests.model.test_vlm import _fields, _grads, _names, _reference, _setup, _stock


@pytest.mark.parametrize(
    ("kind", "chunked_loss"), [("qwen2_vl", True), ("qwen2_5_vl", True), ("llava", True), ("qwen2_vl", False)]
)
def test_dynamic_step_loss_and_gradients_equal_the_stock_model_per_conversation(tmp_path, kind, chunked_loss):
    """The loss from the hidden states (chunked, the default) and from the full logits alike."""
    from lit_seqpack.data.datamodule import SeqPackDataModule

    source, model = _setup(tmp_path, kind, chunked_loss=chunked_loss)
    dm = SeqPackDataModule(source=source, mode="dynamic", seed=0, max_tokens=2048, **_fields(kind))
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 1 and batches[0]["num_documents"] == 16
    batch = batches[0]
    assert batch["input_ids"].shape[0] == 16 and batch.get("cu_seqlens") is None  # padded rows, one a conversation
    assert sum(int(p.shape[0] > 0) for p in batch["pixel_values"]) >= 8
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
