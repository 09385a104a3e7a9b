"""Packed ``trainer.predict``: every sample's log-probabilities equal the model run on that sample alone, every index
once (1 process and 2 gloo ranks), written per rank and merged, and ``lit-seqpack predict`` from the CLI."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from lit_seqpack.data.batching.collate import PackedCollator
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources.files import TokenizedSource
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from lit_seqpack.model.mixin import _VERIFIED
from lit_seqpack.prediction import (
    PredictionWriter,
    merge_predictions,
    predictions_in_order,
    read_predictions,
    sample_predictions,
)
from tests._limits import TEST_TIMEOUT_S
from tests.model._hf_tiny import TINY_HF

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*custom batch sampler.*for prediction.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
]

VOCAB, MAX_TOKENS = 48, 64


def samples(count: int = 37, seed: int = 0) -> list[dict[str, list[int]]]:
    """Samples of 1 to 40 tokens (two of one token), each with a masked prompt of a few tokens."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        length = 1 if i in (3, 20) else int(rng.integers(2, 41))
        ids = rng.integers(1, VOCAB, length).tolist()
        prompt = int(rng.integers(0, length))
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def trainer(**kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        **kwargs,
    )


def reference_model() -> ReferenceLM:
    torch.manual_seed(0)
    return ReferenceLM(vocab_size=VOCAB, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=256)


def hf_model() -> tuple[HFCausalLM, Any]:
    """lit_seqpack's HF module and the stock eager transformers model with the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(config={"model_type": "llama", **TINY_HF})
    stock = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY_HF), attn_implementation="eager")
    stock.load_state_dict(module.model.state_dict())
    return module, stock.eval()


def alone(forward: Any, sample: dict[str, list[int]]) -> tuple[torch.Tensor, float, int]:
    """The sample run alone (``[1, L]``, positions ``0..L-1``): its token log-probs, nll and loss-token count."""
    ids = torch.tensor(sample["input_ids"])[None]
    with torch.no_grad():
        logits = forward(ids, torch.arange(ids.shape[1])[None]).float()
    logprobs = logits[0].log_softmax(-1)
    token = logprobs[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    labels = PackedCollator()([sample])["labels"][0, 1:]  # the collator's labels: -100 on the first token
    kept = labels != -100
    nll = -logprobs[:-1][kept].gather(-1, labels[kept, None]).sum().item()
    return token, nll, int(kept.sum())


def check_against_alone(records: list, data: list[dict[str, list[int]]], forward: Any) -> None:
    assert [r["index"] for r in records] == list(range(len(data)))  # every index once, in order
    for record in records:
        token, nll, count = alone(forward, data[record["index"]])
        assert record["token_logprobs"].shape == (len(data[record["index"]]["input_ids"]) - 1,)
        torch.testing.assert_close(record["token_logprobs"], token, atol=1e-5, rtol=0)
        assert record["nll"] == pytest.approx(nll, abs=1e-4)
        assert record["num_loss_tokens"] == count


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_reference_lm_predictions_equal_each_sample_alone(mode):
    data = samples()
    module = SeqPackDataModule(source=data, mode=mode, max_tokens=MAX_TOKENS, eval_max_tokens=128, val_fraction=0.2)
    model = reference_model()
    records = predictions_in_order(trainer().predict(model, datamodule=module))
    model.eval()
    check_against_alone(records, data, lambda ids, pos: model(ids, position_ids=pos))
    batch = next(iter(module.predict_dataloader()))
    assert int(batch["num_real_tokens"]) > MAX_TOKENS  # planned with the evaluation budget
    if mode == "packing":
        assert len(batch["sample_index"]) == batch["num_documents"] > 1
        assert False in _VERIFIED[model]  # the eval-mode isolation probe ran inside predict's inference_mode


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_hf_llama_predictions_equal_the_stock_model_on_each_sample_alone(mode):
    data = samples(count=21, seed=1)
    module = SeqPackDataModule(source=data, mode=mode, max_tokens=MAX_TOKENS)
    model, stock = hf_model()
    records = predictions_in_order(trainer().predict(model, datamodule=module))
    check_against_alone(records, data, lambda ids, pos: stock(input_ids=ids, position_ids=pos).logits)


def test_predict_with_lightning_defaults_warns_nothing_about_the_sampler():
    """With ``use_distributed_sampler`` left at Lightning's default, predict re-instantiates the loader and would warn
    that a custom batch sampler may not return every index; the planned one does (above), so that warning is gone."""
    data = samples(count=8, seed=3)
    module = SeqPackDataModule(source=data, mode="packing", max_tokens=MAX_TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = predictions_in_order(
            L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).predict(reference_model(), module)
        )
    assert [r["index"] for r in records] == list(range(8))
    assert not [w for w in caught if "batch sampler" in str(w.message)]


def test_predict_source_and_the_training_overlong_policy(tmp_path):
    """predict_source is scored instead of the training data; over-long samples follow the training policy."""
    path = tmp_path / "score.jsonl"
    rows = samples(count=12, seed=2) + [{"input_ids": list(range(1, 48)) * 2}]  # 94 tokens > max_tokens
    path.write_text("".join(json.dumps({"input_ids": r["input_ids"]}) + "\n" for r in rows))
    model = reference_model()
    for overlong, expected in (("truncate", 13), ("drop", 12)):
        module = SeqPackDataModule(
            source=samples(count=5), predict_source=TokenizedSource(str(path)), max_tokens=MAX_TOKENS, overlong=overlong
        )
        records = predictions_in_order(trainer().predict(model, datamodule=module))
        assert [r["index"] for r in records] == list(range(expected))
        if overlong == "truncate":
            assert records[-1]["token_logprobs"].numel() == MAX_TOKENS - 1
        assert module.eval_overlong_reports["predict"].num_overlong == 1


def test_filler_batches_yield_no_record_and_missing_indices_are_refused():
    batch = PackedCollator()([])
    batch["sample_index"] = torch.empty(0, dtype=torch.int64)
    assert sample_predictions(torch.zeros(1, batch["input_ids"].shape[1], 4), batch) == []
    with pytest.raises(ValueError, match="sample_index"):
        sample_predictions(torch.zeros(1, 3, 4), PackedCollator()([{"input_ids": [1, 2, 3]}]))
    with pytest.raises(ValueError, match="sample index 1 was predicted twice"):
        predictions_in_order([[{"index": 1}], [{"index": 0}, {"index": 1}]])


def test_a_stream_source_is_refused_by_name(tmp_path):
    from lit_seqpack.data.sources.file_streams import JsonlStream

    path = tmp_path / "s.jsonl"
    path.write_text('{"input_ids": [1, 2, 3]}\n')
    with pytest.raises(ValueError, match="predict_source must be an indexed source"):
        SeqPackDataModule(source=samples(4), predict_source=JsonlStream(str(path)), max_tokens=MAX_TOKENS)
    with pytest.raises(ValueError, match="trainer.predict needs indexed data"):
        SeqPackDataModule(source=JsonlStream(str(path)), max_tokens=MAX_TOKENS).predict_dataloader()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_the_writer_writes_every_sample_once_and_merges(tmp_path, suffix):
    if suffix == ".parquet":
        pytest.importorskip("pyarrow")
    data = samples(count=15)
    output = tmp_path / f"scores{suffix}"
    writer = PredictionWriter(output)
    model = reference_model()
    module = SeqPackDataModule(source=data, max_tokens=MAX_TOKENS)
    assert trainer(callbacks=[writer]).predict(model, datamodule=module, return_predictions=False) is None
    written = read_predictions(output)
    assert [r["index"] for r in written] == list(range(15)) and writer.merged == 15
    assert not list(tmp_path.glob("scores.rank*"))  # the rank files are merged and removed
    in_memory = predictions_in_order(trainer().predict(model, datamodule=module))
    for got, want in zip(written, in_memory, strict=True):
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"].tolist(), abs=1e-7)
        assert got["nll"] == pytest.approx(want["nll"])


def test_merge_refuses_an_index_in_two_files(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"index": 0}\n{"index": 2}\n')
    second.write_text('{"index": 1}\n')
    assert merge_predictions([second, first], tmp_path / "all.jsonl") == 3
    assert [r["index"] for r in read_predictions(tmp_path / "all.jsonl")] == [0, 1, 2]
    second.write_text('{"index": 2}\n')
    with pytest.raises(ValueError, match=r"sample index 2 is in .*a.jsonl and in .*b.jsonl"):
        merge_predictions([first, second], tmp_path / "all.jsonl")
    with pytest.raises(ValueError, match=r"\.jsonl or \.parquet"):
        PredictionWriter(tmp_path / "scores.csv")


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_every_index_once_over_two_gloo_ranks(tmp_path):
    data = samples(count=29)
    output = tmp_path / "scores.jsonl"
    ddp = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[PredictionWriter(output, keep_rank_files=True)],
    )
    module = SeqPackDataModule(source=data, max_tokens=MAX_TOKENS)
    model = reference_model()
    ddp.predict(model, datamodule=module, return_predictions=False)
    ranks = [[r["index"] for r in read_predictions(tmp_path / f"scores.rank{rank}.jsonl")] for rank in range(2)]
    assert ranks[0] and ranks[1] and not set(ranks[0]) & set(ranks[1])  # each rank scored its own share
    merged = read_predictions(output)
    assert [r["index"] for r in merged] == list(range(29))
    model.eval()
    check_against_alone(
        [{**r, "token_logprobs": torch.tensor(r["token_logprobs"])} for r in merged],
        data,
        lambda ids, pos: model(ids, position_ids=pos),
    )


def test_cli_predict_writes_one_line_per_sample(tmp_path, monkeypatch):
    import yaml

    from lit_seqpack.__main__ import main
    from tests.test_cli import tiny_demo

    monkeypatch.chdir(tmp_path)
    config = tiny_demo(tmp_path)
    settings = yaml.safe_load(config.read_text())
    settings["data"]["source"]["init_args"]["num_samples"] = 60
    config.write_text(yaml.safe_dump(settings))
    main(["predict", "--config", str(config), "--output", "scores.jsonl"])
    lines = Path("scores.jsonl").read_text().splitlines()
    assert [json.loads(line)["index"] for line in lines] == list(range(60))  # held-out samples included
    assert {"index", "token_logprobs", "nll", "num_loss_tokens"} == set(json.loads(lines[0]))
