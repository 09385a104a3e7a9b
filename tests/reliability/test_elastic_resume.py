"""Resuming on another layout: a checkpoint written at an epoch boundary continues on another world size,
``accumulate_grad_batches`` or ``max_tokens``; a mid-epoch one is refused naming the setting.

A 1-rank and a 2-rank reference run (``_resume_harness``: packing, accumulation 2, 2 epochs) write checkpoints at
every kind of epoch boundary Lightning has, and one mid-epoch:

- ``last_batch``: a callback's ``trainer.save_checkpoint`` after the epoch's last microbatch (``on_train_batch_end``);
- ``epochs/epoch=0``: ``ModelCheckpoint`` at the end of the epoch (``on_train_epoch_end``);
- ``steps/step=S``: ``ModelCheckpoint(every_n_train_steps=S)`` landing on the epoch's last optimizer step;
- ``mid``: after an optimizer step in the middle of epoch 1.

Resumed on the other world size (1 -> 2 and 2 -> 1 gloo ranks, Lightning's DDP strategy) or with another
accumulation or ``max_tokens``, every boundary checkpoint must train epoch 1 exactly as the new layout plans it
(``build_plan`` of the new layout, same seed, epoch 1): each sample once over the ranks, ranks in lock-step, the
optimizer steps numbered on from the checkpoint's, and the first step's loss the token mean of its samples under the
checkpoint's weights (<= 1e-5 relative: the exact normalisation follows the new layout). The three routes to the
same boundary train bitwise the same losses.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_seqpack.planning.plan import build_plan
from tests._limits import stages_timeout
from tests.reliability import _resume_harness as harness
from tests.reliability import _train_script as script

RANKS_SCRIPT = Path(__file__).with_name("_elastic_ranks.py")
ROOT = RANKS_SCRIPT.parents[2]
MID = (1, 5)  # after optimizer step 3 of epoch 1


def _steps_per_epoch(world_size: int) -> int:
    return harness.epoch_length("packing", world_size) // harness.ACCUMULATE


def _boundaries(run: Path, world_size: int) -> dict[str, Path]:
    """The epoch-boundary checkpoints of a reference run (see the module docstring)."""
    steps = _steps_per_epoch(world_size)
    return {
        "last_batch": run / "last_batch.ckpt",
        "epoch_end": run / "epochs" / "epoch=0.ckpt",
        "every_n_train_steps": run / "steps" / f"step={steps}.ckpt",
    }


def _job(out: Path, world_size: int, *, ckpt_path: Path | None = None) -> dict:
    """A reference run with its checkpoints (``ckpt_path=None``), or a resume."""
    if ckpt_path is not None:
        return {"out": str(out), "ckpt_path": str(ckpt_path)}
    last = (0, harness.epoch_length("packing", world_size) - 1)
    return {"out": str(out), "save": {"last_batch": last, "mid": MID}, "steps_per_epoch": _steps_per_epoch(world_size)}


def _run_two_ranks(jobs: list[dict], logs: Path) -> None:
    """Every job on 2 gloo ranks, in one process group (``_elastic_ranks.py``)."""
    harness.run_ranks([sys.executable, str(RANKS_SCRIPT), "--jobs", json.dumps(jobs)], logs, "the 2-rank elastic runs")


def _outcome(out: Path, rank: int) -> str | None:
    return json.loads((out / f"outcome.rank{rank}.json").read_text())["error"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``one`` and ``two``: the references; ``one_to_two/<boundary>``: 2-rank resumes of ``one``'s checkpoints."""
    root = tmp_path_factory.mktemp("elastic")
    one = _job(root / "one", 1)
    harness.fit(
        root / "one",
        save={tuple(point): root / "one" / f"{name}.ckpt" for name, point in one["save"].items()},
        callbacks=harness.epoch_checkpoints(root / "one", one["steps_per_epoch"]),
    )
    resumes = {**_boundaries(root / "one", 1), "mid": root / "one" / "mid.ckpt"}
    jobs = [_job(root / "two", 2)]
    jobs += [_job(root / "one_to_two" / name, 2, ckpt_path=ckpt) for name, ckpt in resumes.items()]
    for job in jobs:
        Path(job["out"]).mkdir(parents=True, exist_ok=True)
    _run_two_ranks(jobs, root)
    return root


def _token_mean_loss(ckpt: Path, indices: list[int]) -> float:
    """The token-mean loss of samples ``indices``, one at a time, under the weights of ``ckpt``."""
    model = script.make_model()
    model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"])
    tokens = script.IndexedSamples()._tokens
    total, count = 0.0, 0
    with torch.no_grad():
        for index in indices:
            ids = torch.tensor([tokens[index]])
            total += F.cross_entropy(model(ids)[0, :-1].double(), ids[0, 1:], reduction="sum").item()
            count += ids.shape[1] - 1
    return total / count


def check_next_epoch(
    out: Path, ckpt: Path, world_size: int, *, data: dict | None = None, **layout: int
) -> list[list[dict]]:
    """Assert that the run in ``out``, resumed from the epoch-0 boundary ``ckpt``, trained epoch 1 as the new
    layout plans it (see the module docstring); return its records by rank.

    Args:
        out: the resumed run's records.
        ckpt: the checkpoint it resumed from.
        world_size: its data-parallel ranks.
        data: its other DataModule knobs.
        layout: its ``accumulate_grad_batches`` and ``max_tokens`` when they are not the references'.
    """
    accumulate = layout.get("accumulate_grad_batches", harness.ACCUMULATE)
    budget = {"max_tokens": layout.get("max_tokens", script.MAX_TOKENS)}
    datamodule = harness.make_datamodule("packing", 0, **(data or {}) | budget)
    split, lengths, loss_tokens = datamodule.splits["train"]
    dataset_index = getattr(split, "indices", range(script.NUM_SAMPLES))  # a held-out split views the dataset
    config = datamodule.plan_config(world_size=world_size, accumulate_grad_batches=accumulate)
    plan = build_plan(lengths, config, epoch=1, loss_tokens=loss_tokens)
    records = [harness.records(out, rank) for rank in range(world_size)]
    saved_step = torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"]
    for rank, trained in enumerate(records):
        assert [r["epoch"] for r in trained] == [1] * plan.microbatches_per_rank, f"rank {rank}: epoch 1, in lock-step"
        planned = [plan.microbatch(rank, position).indices for position in range(plan.microbatches_per_rank)]
        assert [r["indices"] for r in trained] == [[int(dataset_index[i]) for i in mb] for mb in planned], (
            f"rank {rank}: the new layout's plan of epoch 1"
        )
        assert [r["step"] for r in trained] == [saved_step + b // accumulate for b in range(len(trained))]
    trained_samples = Counter(i for trained in records for r in trained for i in r["indices"])
    assert trained_samples == Counter(int(i) for i in dataset_index), "every training sample exactly once"
    first = [r for trained in records for r in trained if r["step"] == saved_step]
    # Lightning's recorded loss is divided by the accumulation; DDP averages the ranks' gradients
    loss = sum(r["loss"] for r in first) / world_size
    assert loss == pytest.approx(_token_mean_loss(ckpt, [i for r in first for i in r["indices"]]), rel=1e-5)
    return records


def _losses(records: list[list[dict]]) -> list[list[float]]:
    return [[r["loss"] for r in trained] for trained in records]


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))  # the runs fixture: the 1-rank reference, then the 2-rank runs
def test_one_to_two_ranks_at_an_epoch_boundary_trains_the_next_epoch_once_per_sample(runs: Path) -> None:
    losses = []
    for name, ckpt in _boundaries(runs / "one", 1).items():
        out = runs / "one_to_two" / name
        assert [_outcome(out, rank) for rank in range(script.WORLD)] == [None, None]
        losses.append(_losses(check_next_epoch(out, ckpt, 2)))
    assert losses[0] == losses[1] == losses[2]  # bitwise: the same weights, optimizer state and plan


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))
def test_two_to_one_rank_at_an_epoch_boundary_trains_the_next_epoch_once_per_sample(runs: Path, tmp_path: Path) -> None:
    losses = []
    for name, ckpt in _boundaries(runs / "two", 2).items():
        harness.fit(tmp_path / name, ckpt_path=ckpt)
        losses.append(_losses(check_next_epoch(tmp_path / name, ckpt, 1)))
    assert losses[0] == losses[1] == losses[2]


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))
@pytest.mark.parametrize(
    "layout", [{"accumulate_grad_batches": 4}, {"accumulate_grad_batches": 1}, {"max_tokens": 120}], ids=str
)
def test_another_accumulation_or_max_tokens_at_an_epoch_boundary_plans_the_next_epoch_for_it(
    runs: Path, tmp_path: Path, layout: dict[str, int]
) -> None:
    data = {k: v for k, v in layout.items() if k == "max_tokens"}
    trainer = {k: v for k, v in layout.items() if k == "accumulate_grad_batches"}
    ckpt = _boundaries(runs / "one", 1)["last_batch"]
    harness.fit(tmp_path, ckpt_path=ckpt, data=data, trainer=trainer)
    check_next_epoch(tmp_path, ckpt, 1, **layout)


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))
def test_a_checkpoint_written_after_the_epochs_validation_continues_on_another_layout(tmp_path: Path) -> None:
    """With validation at the epoch's end, ``ModelCheckpoint`` writes in ``on_validation_end``, after the last batch."""
    data = {"val_fraction": 0.1}
    saver = ModelCheckpoint(dirpath=tmp_path / "checkpoints", filename="{epoch}", save_top_k=-1)
    harness.fit(tmp_path / "reference", callbacks=[saver], data=data, trainer={"max_epochs": 1})
    ckpt = tmp_path / "checkpoints" / "epoch=0.ckpt"
    harness.fit(tmp_path / "max_tokens", ckpt_path=ckpt, data=data | {"max_tokens": 120})
    check_next_epoch(tmp_path / "max_tokens", ckpt, 1, data=data, max_tokens=120)
    harness.fit(tmp_path / "accumulate", ckpt_path=ckpt, data=data, trainer={"accumulate_grad_batches": 4})
    check_next_epoch(tmp_path / "accumulate", ckpt, 1, data=data, accumulate_grad_batches=4)


@pytest.mark.slow
@pytest.mark.timeout(stages_timeout(2))
def test_a_mid_epoch_checkpoint_on_another_layout_is_refused_naming_the_setting(runs: Path, tmp_path: Path) -> None:
    boundary = "only a checkpoint written at an epoch boundary continues"
    for rank in range(script.WORLD):  # 1 -> 2 ranks
        error = _outcome(runs / "one_to_two" / "mid", rank)
        assert error.startswith("ValueError: cannot resume mid-epoch (epoch 1, microbatch ") and boundary in error
        assert "on another layout (world_size: checkpoint 1 vs now 2)" in error
    assert harness.records(runs / "one_to_two" / "mid", 0) == []
    changes = [
        ("two", {}, "world_size: checkpoint 2 vs now 1"),
        ("one", {"trainer": {"accumulate_grad_batches": 4}}, "accumulate_grad_batches: checkpoint 2 vs now 4"),
        ("one", {"data": {"max_tokens": 120}}, "max_tokens: checkpoint 128 vs now 120"),
    ]
    for run, change, named in changes:
        with pytest.raises(ValueError, match="cannot resume mid-epoch") as err:
            harness.fit(tmp_path / run, ckpt_path=runs / run / "mid.ckpt", **change)
        assert f"on another layout ({named})" in str(err.value) and boundary in str(err.value)
        assert harness.records(tmp_path / run) == []  # refused before the first batch
