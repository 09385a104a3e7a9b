"""``SeqPackDataModule(source=...)``: settings, resume state, a single-process Trainer resume and the metrics."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lit_seqpack import PackingMonitor, ReferenceLM, SeqPackDataModule
from lit_seqpack.data.sources import GeneratorStream
from lit_seqpack.parallel import DataParallelLayout
from tests.reliability import _stream_train_script as script


def _stream() -> GeneratorStream:
    return GeneratorStream(script.samples, vocab_size=script.VOCAB)


def _module(**kwargs) -> SeqPackDataModule:
    settings = {"source": _stream(), "window": 40, "max_tokens": 128, "num_workers": 0} | kwargs
    return SeqPackDataModule(**settings)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"val_fraction": 0.1}, "val_fraction=0.1 cannot hold samples out of a stream"),
        ({"window": 0}, "window must be an int >= 1"),
        ({"source": "jsonl"}, "source='jsonl' is not a built-in source name"),
        ({"source": 5}, "source must be a map-style dataset .* or 'synthetic', got int"),
        ({"val_source": [{"input_ids": [1, 2]}]}, "val_source / test_source are not supported with a stream source"),
        (
            {"token_fields": {"w": 0.0}, "loss_weight_field": "w"},
            "loss_weight_field='w' is not supported with a stream",
        ),
    ],
)
def test_settings_a_stream_cannot_honour_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)


def test_the_vocabulary_comes_from_the_stream_or_the_error_says_where_to_set_it() -> None:
    assert _module().vocab_size == script.VOCAB
    with pytest.raises(ValueError, match="pass vocab_size= to the stream source"):
        _ = _module(source=GeneratorStream(script.samples)).vocab_size


def test_the_state_resumes_mid_stream_and_refuses_other_window_settings() -> None:
    reference = [b["input_ids"].tolist() for b in _module().train_dataloader()]
    first = _module()
    loader = first.train_dataloader()
    batches = iter(loader)
    head = [next(batches)["input_ids"].tolist() for _ in range(9)]
    state = first.state_dict()
    resumed = _module(num_workers=1)  # 0 or 1 worker reads the share alike (2 or more read lanes: test_lanes.py)
    resumed.load_state_dict(state)
    assert head + [b["input_ids"].tolist() for b in resumed.train_dataloader()] == reference
    other = _module(window=41)
    with pytest.raises(ValueError, match=r"window: 40 -> 41"):
        other.load_state_dict(state)


def test_a_resume_on_another_world_size_accumulation_or_stream_split_is_refused_naming_it() -> None:
    def on_two_ranks(accumulate: int = 1, **kwargs: Any) -> SeqPackDataModule:
        module = _module(**kwargs)
        module.pipeline.layout = DataParallelLayout(world_size=2, rank=0, accumulate_grad_batches=accumulate)
        return module

    state = on_two_ranks().state_dict()
    with pytest.raises(ValueError, match=r"stream_split: 'rank' -> 'replicate'"):
        on_two_ranks(stream_split="replicate").load_state_dict(state)
    with pytest.raises(ValueError, match=r"on another world size \(world_size: 2 -> 1\): .* run on 2 rank") as caught:
        _module().load_state_dict(state)  # the user changed the world size, not stream_split
    assert "stream_split" not in str(caught.value) and "map-style data" in str(caught.value)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches: 1 -> 2"):
        on_two_ranks(accumulate=2).load_state_dict(state)


def test_a_checkpoint_of_the_stream_buffer_era_resumes_with_the_same_window() -> None:
    """Checkpoints written before ``window`` and ``stream_buffer`` were one setting name the buffer ``stream_buffer``
    (and the planner's own ``window``, None); they resume with ``window`` equal to their buffer, refuse another."""
    reference = [b["input_ids"].tolist() for b in _module().train_dataloader()]
    first = _module()
    batches = iter(first.train_dataloader())
    head = [next(batches)["input_ids"].tolist() for _ in range(5)]
    state = first.state_dict()
    facts = state["stream_loader"]["facts"]
    facts["stream_buffer"], facts["window"] = facts.pop("window"), None  # the old layout of the facts
    resumed = _module()
    resumed.load_state_dict(state)
    assert head + [b["input_ids"].tolist() for b in resumed.train_dataloader()] == reference
    with pytest.raises(ValueError, match=r"window: 40 -> 41"):
        _module(window=41).load_state_dict(state)


def _fit(out: Path, ckpt: Path | None = None) -> L.Trainer:
    out.mkdir(exist_ok=True)
    L.seed_everything(0, verbose=False)
    model = ReferenceLM(
        vocab_size=script.VOCAB, n_layer=1, n_head=2, n_kv_head=1, n_embd=32, intermediate_size=64,
        max_seq_len=script.MAX_TOKENS, lr=3e-3, lr_schedule="constant", attn_backend="sdpa",
    )  # fmt: skip
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=CSVLogger(out, name="", version=""),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
        callbacks=[
            script.StreamTrainedLog(out),
            PackingMonitor(summary=False),
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=5, save_top_k=-1, filename="{step}"),
        ],
    )
    trainer.fit(model, datamodule=script.make_datamodule(num_workers=1), ckpt_path=ckpt)
    return trainer


def _records(out: Path) -> list[str]:
    return (out / "rank0.jsonl").read_text().splitlines()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trainer_resumes_a_stream_exactly_and_logs_the_packing_metrics(tmp_path: Path) -> None:
    """One process (the loop counters restored before the loader starts, unlike the DDP test's schedule)."""
    _fit(tmp_path / "reference")
    reference = _records(tmp_path / "reference")
    with open(tmp_path / "reference" / "metrics.csv") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("train/packing_efficiency")]
    assert rows and all(0 < float(row["train/packing_efficiency"]) <= 1 for row in rows)
    assert all(float(row["train/tokens_per_sec"]) > 0 for row in rows)
    tokens = sum(len(s["input_ids"]) for s in script.samples())
    assert float(rows[-1]["train/real_tokens"]) == 2 * tokens  # every streamed token counted, both epochs
    for step in (5, 35):  # mid epoch 0 and mid epoch 1 (the stream's steps per epoch: between 5 and 35)
        ckpt = tmp_path / "reference" / "ckpt" / f"step={step}.ckpt"
        _fit(tmp_path / f"from{step}", ckpt)
        done = [r for r in reference if int(r.split('"step": ')[1].split(",")[0]) < step]
        assert done + _records(tmp_path / f"from{step}") == reference, step


def test_inspect_plans_a_stream_prefix_and_compares_the_windows_with_the_offline_plan() -> None:
    from lit_seqpack.__main__ import inspect_command

    config = Path(__file__).resolve().parents[3] / "configs" / "stream.yaml"
    report = inspect_command(["--config", str(config), "--max_samples", "5000", "--data.overlong", "drop"])
    assert "data: stream prefix (" in report
    assert "over-long: 1 of 5000 samples are longer than max_tokens=1024" in report  # counted on the prefix
    line = next(line for line in report.splitlines() if line.startswith("stream: SyntheticStream, first 4,999"))
    assert float(line.rsplit("ratio ", 1)[1].rstrip(")")) >= 0.98
    with pytest.raises(ValueError, match="max_samples must be an int >= 1"):
        inspect_command(["--config", str(config), "--max_samples", "0"])


def test_the_overlong_report_counts_the_stream_read_so_far_also_across_a_resume() -> None:
    lengths = [len(s["input_ids"]) for s in script.samples()]
    over = [n for n in lengths if n > 64]
    full = _module(max_tokens=64, overlong="drop")
    for _ in full.train_dataloader():
        pass
    assert full.overlong_report.num_dropped == len(over) > 0
    assert full.overlong_report.tokens_dropped == sum(over)
    first = _module(max_tokens=64, overlong="drop")
    batches = iter(first.train_dataloader())
    for _ in range(20):
        next(batches)
    resumed = _module(max_tokens=64, overlong="drop")
    resumed.load_state_dict(first.state_dict())
    for _ in resumed.train_dataloader():
        pass
    assert resumed.overlong_report == full.overlong_report


def _fielded_samples() -> Any:
    """Samples numbered in ``doc``, with a token field ``score`` that is a function of each token and its position."""
    rng = np.random.default_rng(5)
    for doc in range(60):
        ids = rng.integers(1, script.VOCAB, int(rng.integers(2, 200))).tolist()
        yield {"input_ids": ids, "score": [t + i / 1000 for i, t in enumerate(ids)], "doc": doc}


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_declared_fields_travel_aligned_through_streamed_batches_also_truncated(mode: str) -> None:
    """``score`` stays on its tokens and ``doc`` on its document, in packed rows and padded blocks, with the
    samples longer than the budget cut by ``overlong="truncate"`` (fields cut with their tokens)."""
    samples = list(_fielded_samples())
    assert max(len(s["input_ids"]) for s in samples) > 128  # some samples are cut
    module = _module(
        source=GeneratorStream(_fielded_samples, vocab_size=script.VOCAB),
        mode=mode,
        overlong="truncate",
        token_fields={"score": 0.0},
        sample_fields=["doc"],
    )
    seen = []
    for batch in module.train_dataloader():
        ids, score, docs = batch["input_ids"], batch["score"], batch["doc"].tolist()
        if mode == "packing":
            bounds = batch["cu_seqlens"].tolist()
            rows = [(ids[0, a:b], score[0, a:b]) for a, b in zip(bounds, bounds[1:], strict=False)][: len(docs)]
        else:
            rows = [(ids[r][m.bool()], score[r][m.bool()]) for r, m in enumerate(batch["attention_mask"])]
            assert bool((score[batch["attention_mask"] == 0] == 0.0).all())  # the pad value on padding
        assert len(rows) == len(docs)
        for doc, (tokens, values) in zip(docs, rows, strict=True):
            expected = samples[doc]["input_ids"][: module.overlong_report.max_tokens]
            assert tokens.tolist() == expected
            assert values.tolist() == pytest.approx([t + i / 1000 for i, t in enumerate(expected)])
        seen += docs
    assert sorted(seen) == list(range(60))
    assert module.overlong_report.num_truncated == sum(len(s["input_ids"]) > 128 for s in samples) > 0


def test_a_token_field_of_another_length_than_the_tokens_is_refused_before_the_cut() -> None:
    def samples() -> Any:
        yield {"input_ids": [1] * 200, "score": [0.0] * 300}

    module = _module(source=GeneratorStream(samples, vocab_size=script.VOCAB), overlong="truncate",
                     token_fields={"score": 0.0})  # fmt: skip
    with pytest.raises(ValueError, match="stream sample 0: score has 300 entries but input_ids has 200"):
        next(iter(module.train_dataloader()))


def test_a_stream_has_no_test_split_and_the_error_says_so() -> None:
    with pytest.raises(ValueError, match="a stream has no test split .* second SeqPackDataModule"):
        _module().test_dataloader()
    assert _module().val_dataloader() == []
