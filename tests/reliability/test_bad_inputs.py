"""The bad-input matrix: every mistake fails fast naming the knob and the value, or is handled and counted.

Each test drives the user-facing layer (SeqPackDataModule, the samplers, the collators, varlen_attention, a
LightningModule with the mixin inside a Trainer, Lightning's CLI parser) and checks the message a user reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch import LightningModule

from lit_seqpack import (
    PackedCollator,
    PackedSequenceMixin,
    PaddedCollator,
    PlanConfig,
    PlannedBatchSampler,
    ReferenceLM,
    SeqPackDataModule,
    varlen_attention,
)
from lit_seqpack.cli import SeqPackCLI
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.sources import SyntheticInstructionDataset, TokenizedSource
from lit_seqpack.data.sources.tokenized import TokenizedDataset
from lit_seqpack.model.attention import BackendUnavailableError
from lit_seqpack.model.isolation import PackingLeakError

SYNTH = {"num_samples": 40, "median_length": 12, "max_length": 40, "vocab_size": 64, "seed": 3}
SYNTH_SOURCE = {"class_path": "lit_seqpack.data.sources.SyntheticInstructionDataset", "init_args": SYNTH}


def _records(*lengths: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": [1 + (i + j) % 50 for j in range(n)]} for i, n in enumerate(lengths)]


def _batches(dm: SeqPackDataModule) -> list[dict[str, Any]]:
    return list(dm.train_dataloader())


def _tiny_lm(**kwargs: Any) -> ReferenceLM:
    torch.manual_seed(0)
    return ReferenceLM(vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32, **kwargs)


def _trainer(root: Path, **kwargs: Any) -> L.Trainer:
    defaults = {"accelerator": "cpu", "devices": 1, "logger": False, "enable_progress_bar": False}
    defaults |= {"enable_model_summary": False, "default_root_dir": root, "use_distributed_sampler": False}
    return L.Trainer(**(defaults | kwargs))


# ----------------------------------------------------------------------------------------------------- empty
def test_empty_dataset_fails_at_setup() -> None:
    with pytest.raises(ValueError, match="the dataset is empty"):
        SeqPackDataModule(source=[]).setup("fit")


def test_empty_lengths_plan_an_empty_epoch_at_the_sampler_layer() -> None:
    assert (
        len(PlannedBatchSampler([], PlanConfig(mode="packing", max_tokens=8))) == 0
        and list(PlannedBatchSampler([], PlanConfig(mode="packing", max_tokens=8))) == []
    )


class _WithLengths(list):
    """A list dataset that offers its lengths and loss tokens (the fast path: the DataModule reads no sample)."""

    @property
    def lengths(self) -> list[int]:
        return [len(sample["input_ids"]) for sample in self]

    @property
    def loss_tokens(self) -> list[int]:
        return [max(n - 1, 0) for n in self.lengths]


def test_a_zero_length_sample_fails_at_setup_naming_its_dataset_index() -> None:
    records = [*_records(3, 5), {"input_ids": []}, *_records(4)]
    with pytest.raises(ValueError, match=r"dataset\[2\]: 'input_ids' is empty"):  # read once for the lengths
        SeqPackDataModule(source=records, max_tokens=16).setup("fit")
    with pytest.raises(ValueError, match=r"dataset\[2\]: 'input_ids' is empty"):  # read too: it is validated
        SeqPackDataModule(source=_WithLengths(records), max_tokens=16).setup("fit")
    with pytest.raises(ValueError, match="input_ids is empty"):
        PackedCollator()([{"input_ids": []}])


# -------------------------------------------------------------------------------------------------- over-long
@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_overlong_error_names_the_sample_the_budget_and_the_policy(mode: str) -> None:
    dm = SeqPackDataModule(source=_records(5, 30, 7), mode=mode, max_tokens=16)
    with pytest.raises(ValueError, match=r"1 of 3 samples are longer than max_tokens=16 \(first: #1: 30\).*overlong="):
        dm.setup("fit")
    with pytest.raises(ValueError, match=r"sample 1 has length 30 > max_tokens=16"):
        PlannedBatchSampler([5, 30, 7], PlanConfig(mode=mode, max_tokens=16))


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_overlong_truncate_is_counted_and_trains_the_first_max_tokens(mode: str) -> None:
    dm = SeqPackDataModule(source=_records(5, 30, 7), mode=mode, max_tokens=16, overlong="truncate")
    batches = _batches(dm)
    report = dm.overlong_report
    assert (report.num_overlong, report.num_truncated, report.tokens_truncated) == (1, 1, 14)
    assert sum(b["num_real_tokens"] for b in batches) == 5 + 16 + 7
    assert all(b["input_ids"].numel() <= 16 for b in batches)
    assert sum(b["num_loss_tokens"] for b in batches) == 4 + 15 + 6


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_overlong_drop_is_counted_and_only_the_dropped_sample_is_missing(mode: str) -> None:
    dm = SeqPackDataModule(source=_records(5, 30, 7, 40), mode=mode, max_tokens=16, overlong="drop")
    batches = _batches(dm)
    report = dm.overlong_report
    assert (report.num_dropped, report.tokens_dropped, report.indices) == (2, 70, (1, 3))
    assert sorted(i for mb in dm.train_dataloader().batch_sampler for i in mb) == [0, 1]  # the 2 kept samples
    assert sum(b["num_real_tokens"] for b in batches) == 12
    with pytest.raises(ValueError, match=r"overlong='drop' would drop all 2 samples; raise max_tokens=4"):
        SeqPackDataModule(source=_records(30, 40), mode=mode, max_tokens=4, overlong="drop").setup("fit")


# ------------------------------------------------------------------------------------------ token values
@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            _records(3) + [{"input_ids": [1, 2.5, 3]}],
            r"dataset\[1\]: 'input_ids' must be a flat list of ints, found float",
        ),
        (
            _records(3) + [{"input_ids": ["a", "b"]}],
            r"dataset\[1\]: 'input_ids' must be a flat list of ints, found str",
        ),
        (_records(3, 2) + [{"input_ids": [4, -4]}], r"dataset\[2\]: 'input_ids' has negative id -4 at position 1"),
        ([{"input_ids": [4, 5], "labels": [4, -7]}], r"dataset\[0\]: 'labels' has -7 at position 1"),
    ],
)
def test_tokens_that_are_not_non_negative_integers_fail_at_setup(records: list[dict], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SeqPackDataModule(source=records, max_tokens=16).setup("fit")


@pytest.mark.parametrize("collator", [PackedCollator(), PaddedCollator()])
@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"input_ids": [1.0, 2.0]}, "sample 1: input_ids must hold integers, got dtype torch.float64"),
        ({"input_ids": torch.tensor([3, -1])}, r"sample 1: input_ids must be >= 0 \(found a negative id\)"),
        ({"input_ids": [1, 2], "labels": [1, -5]}, "sample 1: labels must be >= 0 or -100"),
    ],
)
def test_collators_refuse_bad_token_values(collator: Any, sample: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message) if "(" not in message else message):
        collator([{"input_ids": [1, 2]}, sample])


def test_a_jsonl_file_with_a_negative_id_fails_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps({"input_ids": [3, -9]}) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl, line 2: 'input_ids' has negative id -9"):
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16).setup("fit")


# ---------------------------------------------------------------------------------- labels and loss masks
def test_labels_of_the_wrong_length_fail_naming_both_lengths() -> None:
    records = [*_records(4), {"input_ids": [1, 2, 3], "labels": [1, 2]}]
    with pytest.raises(ValueError, match=r"dataset\[1\]: 'labels' has 2 entries but 'input_ids' has 3"):
        SeqPackDataModule(source=records, max_tokens=16).setup("fit")
    for collator in (PackedCollator(), PaddedCollator()):
        with pytest.raises(ValueError, match="sample 0: labels has 2 entries but input_ids has 3"):
            collator([records[1]])
    with pytest.raises(ValueError, match=r"labels hold 2 entries but tokens hold 3"):
        TokenizedDataset(np.array([1, 2, 3]), np.array([0, 3]), np.array([1, 2]))


def test_a_loss_mask_counts_in_the_plan_and_in_a_jsonl_file(tmp_path: Path) -> None:
    """Regression: a loss_mask was planned as length - 1 loss tokens (a wrong exact-loss scale) and ignored in JSONL."""
    records = [
        {"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1]},
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
    ]
    path = tmp_path / "masked.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    for dm in (
        SeqPackDataModule(source=records, max_tokens=16),
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16),
    ):
        (batch,) = _batches(dm)
        assert batch["labels"].tolist() == [[-100, -100, -100, 8, 9, -100, 6, 7]]
        assert batch["num_loss_tokens"] == batch["step_loss_tokens"] == 4
    path.write_text(json.dumps({"input_ids": [5, 6], "loss_mask": [1, 2]}))
    with pytest.raises(ValueError, match=r"line 1: 'loss_mask' must hold only 0 and 1, got \[1, 2\]"):
        SeqPackDataModule(source=TokenizedSource(str(path), format="jsonl"), max_tokens=16).setup("fit")


# ------------------------------------------------------------------------------------------- budget knobs
@pytest.mark.parametrize("max_tokens", [0, -5, None])
def test_max_tokens_below_one_fails_at_construction(max_tokens: int | None) -> None:
    message = f"max_tokens must be an int >= 1, got {max_tokens}"
    for build in (
        lambda: SeqPackDataModule(max_tokens=max_tokens),
        lambda: SeqPackDataModule(mode="dynamic", max_tokens=max_tokens),
        lambda: PlannedBatchSampler([3, 4], PlanConfig(mode="packing", max_tokens=max_tokens)),
        lambda: PlannedBatchSampler([3, 4], PlanConfig(mode="dynamic", max_tokens=max_tokens)),
        lambda: PlanConfig(mode="packing", max_tokens=max_tokens),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            build()


def test_a_row_multiple_that_does_not_divide_the_budget_fails_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_tokens=100 must be a multiple of sequence_length_round=64"):
        SeqPackDataModule(max_tokens=100, sequence_length_round=64)
    with pytest.raises(ValueError, match=r"max_tokens=100 must be a multiple of sequence_length_round=128"):
        PlannedBatchSampler([3], PlanConfig(mode="packing", max_tokens=100, sequence_length_round=128))
    with pytest.raises(ValueError, match=r"pad_to_multiple_of must be an int >= 1 or None, got 0"):
        PackedCollator(pad_to_multiple_of=0)


def test_a_document_pad_multiple_larger_than_the_budget_fails_at_construction() -> None:
    """Regression: it failed at setup with "sample 0 has length 128 > max_tokens=64" for a 10-token sample."""
    with pytest.raises(ValueError, match=r"max_tokens=64 cannot hold a single document: pad_to_multiple_of=128"):
        SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=64, pad_to_multiple_of=128)


def test_a_document_pad_multiple_outside_packing_is_refused_not_ignored() -> None:
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=8 pads the documents of a packed row .* mode='dynamic'"):
        SeqPackDataModule(mode="dynamic", max_tokens=64, pad_to_multiple_of=8)


@pytest.mark.parametrize("overlong", ["error", "truncate", "drop"])
def test_a_document_pad_multiple_applies_the_overlong_policy_to_padded_lengths(overlong: str) -> None:
    """60 tokens fit max_tokens=64 but pad to 96 with pad_to_multiple_of=48: the budget holds 48 per document."""
    dm = SeqPackDataModule(source=_records(60, 3), max_tokens=64, pad_to_multiple_of=48, overlong=overlong)
    if overlong == "error":
        with pytest.raises(ValueError, match=r"max_tokens=64 holds documents of at most 48 tokens because pad_to_m"):
            dm.setup("fit")
        return
    batches = _batches(dm)
    assert all(b["input_ids"].shape[1] <= 64 for b in batches)
    assert all((torch.diff(b["cu_seqlens"]) % 48 == 0).all() for b in batches)
    report = dm.overlong_report
    assert (report.num_truncated, report.num_dropped) == ((1, 0) if overlong == "truncate" else (0, 1))
    assert sum(b["num_real_tokens"] for b in batches) == (48 + 3 if overlong == "truncate" else 3)


# ------------------------------------------------------------------------------------- more ranks than samples
def test_more_ranks_than_samples_get_counted_zero_weight_fillers() -> None:
    lengths, world = [5, 7, 3], 8
    samplers = [
        PlannedBatchSampler(lengths, PlanConfig(mode="packing", max_tokens=8, world_size=world), rank=r)
        for r in range(world)
    ]
    per_rank = [list(s) for s in samplers]
    assert {len(mbs) for mbs in per_rank} == {1}  # lock-step: one microbatch each, nobody waits forever
    assert sorted(i for mbs in per_rank for mb in mbs for i in mb) == [0, 1, 2]
    assert samplers[0].plan.stats.num_empty_microbatches == 5
    fillers = [mbs[0] for mbs in per_rank if mbs[0].meta.is_empty]
    assert len(fillers) == 5
    batch = PackedCollator()(PlannedDataset(_records(*lengths)).__getitems__(fillers[0]))
    assert batch["is_empty"] and batch["num_loss_tokens"] == 0 and (batch["labels"] == -100).all()
    model = _tiny_lm(lr_schedule="constant")
    model.seqpack_step(batch, "train").backward()  # a zero that still reaches every parameter (no DDP hang)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


# --------------------------------------------------------------------------------------- configuration
def _cli(tmp_path: Path, data: dict[str, Any]) -> SeqPackCLI:
    """The lit-seqpack CLI on a YAML config (JSON is YAML) with this data section, without running a subcommand."""
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps({"model": {"class_path": "lit_seqpack.ReferenceLM"}, "data": data}))
    return SeqPackCLI(args=["--config", str(path), "--trainer.logger", "false"], run=False)


@pytest.mark.parametrize(
    ("knob", "value", "choices"),
    [("mode", "both", "'packing', 'dynamic', 'padded'"), ("overlong", "skip", "'error', 'truncate', 'drop', 'split'")],
)
def test_an_unknown_mode_or_policy_in_yaml_is_refused_by_the_cli_parser(
    tmp_path: Path, capsys: pytest.CaptureFixture, knob: str, value: str, choices: str
) -> None:
    with pytest.raises(SystemExit):
        _cli(tmp_path, {knob: value, "source": SYNTH_SOURCE})
    err = capsys.readouterr().err
    assert f'Parser key "data.{knob}"' in err and f"Literal[{choices}]. Got value: {value}" in err
    with pytest.raises(ValueError, match=rf"{knob}='{value}' must be one of \({choices}\)"):
        SeqPackDataModule(source=_records(5), **{knob: value}).setup("fit")


def test_an_unknown_algorithm_in_yaml_fails_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"algorithm must be one of \('concatenative'.*\), got 'tetris'"):
        _cli(tmp_path, {"algorithm": "tetris", "source": SYNTH_SOURCE})


# ----------------------------------------------------------------------------------------------- attention
def test_an_explicit_backend_that_is_not_installed_fails_with_the_fix() -> None:
    q = torch.randn(6, 2, 8)
    cu_seqlens = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(BackendUnavailableError, match=r"attention backend 'flash_attn' is unavailable: .*sdpa"):
        varlen_attention(q, q, q, cu_seqlens, 4, backend="flash_attn")
    with pytest.raises(ValueError, match=r"backend must be 'auto' or one of .*, got 'xformers'"):
        varlen_attention(q, q, q, cu_seqlens, 4, backend="xformers")


def test_a_model_asking_for_flash_attn_on_cpu_fails_at_its_first_step(tmp_path: Path) -> None:
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=64)
    with pytest.raises(BackendUnavailableError, match="attention backend 'flash_attn' is unavailable"):
        _trainer(tmp_path, max_steps=1).fit(_tiny_lm(attn_backend="flash_attn"), datamodule=dm)


class StockHFModule(PackedSequenceMixin, LightningModule):
    """A transformers Llama called the usual way (positions only): its attention crosses packed documents."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128,
        )  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_hf_model_whose_attention_ignores_packed_boundaries_is_refused_in_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    module = StockHFModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(PackingLeakError, match="StockHFModule does not keep the documents of a packed row apart"):
        _trainer(tmp_path, max_steps=2).fit(
            module, datamodule=SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=64)
        )
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())  # not one step was trained


# ------------------------------------------------------------------------------------------------ resume
def _checkpoint_mid_epoch(tmp_path: Path) -> Path:
    dm = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=64, num_workers=0)
    trainer = _trainer(tmp_path, max_steps=2, enable_checkpointing=False)
    trainer.fit(_tiny_lm(), datamodule=dm)
    assert trainer.global_step < len(dm.train_dataloader())  # mid-epoch
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    return tmp_path / "mid.ckpt"


def test_resuming_on_other_data_or_another_layout_fails_naming_what_changed(tmp_path: Path) -> None:
    ckpt = _checkpoint_mid_epoch(tmp_path)
    other_count = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH | {"num_samples": 30}), max_tokens=64)
    with pytest.raises(ValueError, match=r"cannot resume: .*num_samples: checkpoint 40 vs now 30"):
        _trainer(tmp_path, max_steps=4).fit(_tiny_lm(), datamodule=other_count, ckpt_path=ckpt)
    other_lengths = SeqPackDataModule(
        source=SyntheticInstructionDataset(**SYNTH | {"seed": 4}), max_tokens=64
    )  # 40 samples, other lengths
    with pytest.raises(
        ValueError, match=r"cannot resume: .*train_lengths: checkpoint '[0-9a-f]{16}' vs now '[0-9a-f]{16}'"
    ):
        _trainer(tmp_path, max_steps=4).fit(_tiny_lm(), datamodule=other_lengths, ckpt_path=ckpt)
    same_data = SeqPackDataModule(source=SyntheticInstructionDataset(**SYNTH), max_tokens=64)
    with pytest.raises(ValueError, match=r"accumulate_grad_batches: checkpoint 1 vs now 2"):
        _trainer(tmp_path, max_steps=4, accumulate_grad_batches=2).fit(_tiny_lm(), datamodule=same_data, ckpt_path=ckpt)
