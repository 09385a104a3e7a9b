"""The resume matrix: modes x workers at save and resume x checkpoint point x strategy, against one uninterrupted run.

Every cell resumes from a checkpoint that an uninterrupted reference run wrote after a chosen microbatch (see
``_resume_harness``) and must train exactly the reference's remaining microbatches, with the same dataset indices
and bitwise the same losses (so the same weights, optimizer and schedule state; the schedule is cosine over
``trainer.estimated_stepping_batches``, which makes Lightning build the train loader before the restore). A
checkpoint inside a gradient-accumulation window holds no partial gradient: the resume must restart at that
optimizer step's first microbatch and train the whole step again.

Checkpoint points: ``step`` (an optimizer-step boundary mid-epoch 1), ``window`` (after the first microbatch of
a step in epoch 0) and ``epoch_end`` (after the last microbatch of epoch 0).

The single-process cells run the DataModule's two restore orders: ``single`` (restored before the train loader is
built, as DDP does) and ``late`` (after, as FSDP/ModelParallel/DeepSpeed do). The 2-process cells run DDP, FSDP2
(``ModelParallelStrategy``) and FSDP1 on gloo in one spawned job. ``LIT_SEQPACK_RESUME_MATRIX=full`` runs every
single-process combination (the default run keeps a subset; docs/reliability.md "Resume" lists both).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests._limits import TEST_TIMEOUT_S
from tests.reliability import _resume_harness as harness
from tests.reliability import _train_script as script

FULL = os.environ.get("LIT_SEQPACK_RESUME_MATRIX") == "full"
RANKS_SCRIPT = Path(__file__).with_name("_resume_ranks.py")
ROOT = RANKS_SCRIPT.parents[2]


def points(mode: str, world_size: int) -> dict[str, tuple[int, int]]:
    """``(epoch, batch_idx)`` after which each checkpoint is written (accumulation 2)."""
    last = harness.epoch_length(mode, world_size) - 1
    return {"step": (1, 5), "window": (0, 2), "epoch_end": (0, last)}


def step_start(point: tuple[int, int]) -> tuple[int, int]:
    """The last microbatch before the optimizer step that holds microbatch ``point``: where a resume restarts."""
    epoch, batch_idx = point
    return epoch, batch_idx - (batch_idx + 1) % harness.ACCUMULATE


def _expect(reference: list[dict], point: tuple[int, int], outcome: str | None, resumed: list[dict]) -> str | None:
    """``None`` if the cell trained exactly what the reference trained after the step holding ``point``."""
    if outcome is not None:
        return outcome
    return harness.compare(resumed, harness.after(reference, step_start(point)))


def _single_cells(save_workers: int) -> list[tuple[str, str, int]]:
    """``(point, strategy, resume workers)`` of one reference run (all of them with ``FULL``)."""
    cells = [(point, "late", workers) for point in ("step", "window", "epoch_end") for workers in (0, 1, 2)]
    cells += [("step", "single", workers) for workers in (0, 1, 2)]
    if FULL:
        cells += [(p, "single", w) for p in ("window", "epoch_end") for w in (0, 1, 2)]
    return cells


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("mode", ["packing", "dynamic", "padded"])
def test_single_process_resume_matrix(tmp_path: Path, mode: str) -> None:
    failures, table = [], []
    at = points(mode, 1)
    for save_workers in (0, 2) if not FULL else (0, 1, 2):
        run = tmp_path / f"save{save_workers}"
        harness.fit(
            run / "reference", mode=mode, num_workers=save_workers, save={p: run / f"{n}.ckpt" for n, p in at.items()}
        )
        reference = harness.records(run / "reference")
        for point, strategy, workers in _single_cells(save_workers):
            out, outcome = run / f"{point}-{strategy}-{workers}", None
            try:
                harness.fit(out, strategy=strategy, mode=mode, num_workers=workers, ckpt_path=run / f"{point}.ckpt")
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            problem = _expect(reference, at[point], outcome, harness.records(out))
            table.append(f"| {mode} | {strategy} | {save_workers} -> {workers} | {point} | {problem or 'ok'} |")
            if problem:
                failures.append(table[-1])
    print("\n".join(table))
    assert not failures, "\n".join(failures)


CELLS = [  # 2 gloo processes; (point, resume workers) per reference run
    {"strategy": "ddp", "mode": "packing", "save_workers": 1, "resumes": [["step", 1], ["step", 0], ["window", 1]]},
    {"strategy": "ddp", "mode": "dynamic", "save_workers": 0, "resumes": [["step", 2], ["epoch_end", 0]]},
    {"strategy": "ddp", "mode": "padded", "save_workers": 2, "resumes": [["step", 1], ["epoch_end", 2]]},
    {"strategy": "fsdp2", "mode": "packing", "save_workers": 0, "resumes": [["step", 0], ["step", 2], ["window", 0]]},
    {"strategy": "fsdp1", "mode": "packing", "save_workers": 0, "resumes": [["step", 0], ["epoch_end", 1]]},
]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("resume_ranks")
    cells = [
        cell | {"name": f"{cell['strategy']}-{cell['mode']}", "points": points(cell["mode"], script.WORLD)}
        for cell in CELLS
    ]
    harness.run_ranks(
        [sys.executable, str(RANKS_SCRIPT), "--out", str(out), "--cells", json.dumps(cells)],
        out,
        "the 2-rank resume matrix",
    )
    return out, cells


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_rank_resume_matrix_ddp_fsdp2_fsdp1(two_rank_runs: tuple[Path, list[dict]]) -> None:
    out, cells = two_rank_runs
    failures, table = [], []
    for cell in cells:
        run = out / cell["name"]
        reference = [harness.records(run / "reference", rank) for rank in range(script.WORLD)]
        for epoch in range(harness.EPOCHS):
            trained = Counter(i for ranks in reference for r in ranks if r["epoch"] == epoch for i in r["indices"])
            assert trained == Counter(range(script.NUM_SAMPLES)), f"{cell['name']} epoch {epoch}: each sample once"
        for point, workers in cell["resumes"]:
            problems = []
            for rank in range(script.WORLD):
                outcome = json.loads((run / f"{point}-{workers}.rank{rank}.json").read_text())["error"]
                resumed = harness.records(run / f"{point}-{workers}", rank)
                if problem := _expect(reference[rank], tuple(cell["points"][point]), outcome, resumed):
                    problems.append(f"rank {rank}: {problem}")
            row = f"| {cell['mode']} | {cell['strategy']} | {cell['save_workers']} -> {workers} | {point} |"
            table.append(f"{row} {'; '.join(problems) or 'ok'} |")
            if problems:
                failures.append(table[-1])
    print("\n".join(table))
    assert not failures, "\n".join(failures)
