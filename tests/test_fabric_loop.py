"""examples/fabric_loop.py: one optimizer step of the Fabric loop with accumulation 2 equals one big padded batch.

The example writes rank 0's gradients of the first step (after DDP's all-reduce), the initial weights and every
sample of the step (all ranks); the ground truth is :func:`tests.model.test_exact_loss.reference_gradients`.
Single process runs in-process; 2 gloo processes go through Fabric(strategy="ddp") as a user would launch them.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.mixin import FabricAccumulation
from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S
from tests.model.test_exact_loss import assert_gradients_match, reference_gradients

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "fabric_loop.py")
ARGS = ["--max-steps", "1", "--precision", "64-true", "--num-samples", "120", "--max-tokens", "128"]


def _run_in_process(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [SCRIPT, *args])
    runpy.run_path(SCRIPT, run_name="__main__")


def _check_saved_step(path: Path, microbatches: int) -> float:
    saved = torch.load(path)
    module = ReferenceLM(**saved["hparams"])
    module.load_state_dict(saved["initial"])
    assert len(saved["samples"]) > microbatches  # several documents per packed row, every rank's
    expected = reference_gradients(module, saved["samples"])
    assert_gradients_match(saved["grads"], expected, rtol=1e-5)
    return max((saved["grads"][k].double() - g).abs().max().item() / g.abs().max().item() for k, g in expected.items())


def test_single_process_loop_with_accumulation_2_equals_the_big_padded_batch(monkeypatch, tmp_path):
    path = tmp_path / "step.pt"
    _run_in_process(monkeypatch, *ARGS, "--accumulate-grad-batches", "2", "--save-first-step", str(path))
    assert _check_saved_step(path, 2) <= 1e-5


def test_a_plan_for_another_accumulation_raises(monkeypatch):
    with pytest.raises(ValueError, match="planned for world_size=1, accumulate_grad_batches=1 but the trainer runs "
                       "world_size=1, accumulate_grad_batches=2"):  # fmt: skip
        _run_in_process(monkeypatch, *ARGS, "--accumulate-grad-batches", "2", "--plan-accumulation", "1")


def test_a_batch_planned_for_another_world_size_raises():
    fabric = SimpleNamespace(world_size=2, strategy=None)
    batch = {"world_size": 1, "accumulate_grad_batches": 2}
    with pytest.raises(ValueError, match="planned for world_size=1, .* runs world_size=2"):
        FabricAccumulation(fabric, accumulate_grad_batches=2).check(batch)
    FabricAccumulation(fabric, accumulate_grad_batches=2).check({**batch, "world_size": 2})
    with pytest.raises(ValueError, match="accumulate_grad_batches must be an int >= 1"):
        FabricAccumulation(fabric, accumulate_grad_batches=0)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_two_gloo_processes_with_accumulation_2_equal_the_big_padded_batch(tmp_path):
    path = tmp_path / "step.pt"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = [*ARGS, "--devices", "2", "--accumulate-grad-batches", "2", "--save-first-step", str(path)]
    result = subprocess.run([sys.executable, SCRIPT, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x 2 ranks" in result.stdout
    assert _check_saved_step(path, 4) <= 1e-5
