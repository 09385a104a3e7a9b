"""The scripts under examples/ run end to end with tiny settings, as a user would run them (subprocesses)."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)  # most tests run an example in a subprocess


def _run(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr


def test_every_example_is_tested():  # fabric_loop.py: tests/test_fabric_loop.py
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == [
        "compare_modes.py",
        "dpo.py",
        "fabric_loop.py",
        "grpo.py",
        "hf_model.py",
        "own_model.py",
        "ppo.py",
    ]


@pytest.mark.parametrize("script", ["own_model.py", "hf_model.py", "compare_modes.py", "fabric_loop.py"])
def test_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")  # in-process: torch is already imported
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--max-steps" in out


@pytest.mark.parametrize("mode", ["packing", "dynamic"])
def test_own_model_trains_in_both_modes(mode, tmp_path):
    args = ["--mode", mode, "--max-steps", "6", "--num-samples", "200", "--max-tokens", "256"]
    out = _run("own_model.py", *args, cwd=tmp_path)
    line = re.search(rf"^{mode}: 6 steps in .* padding ratio ([\d.]+)%, ([\d,]+) real tokens/s", out, re.M)
    assert line is not None, out[-2000:]
    assert "PackingMonitor summary" in out
    assert (float(line[1]) < 1.0) if mode == "packing" else (float(line[1]) > 0.0)


def test_hf_model_is_isolated_and_trains(tmp_path):
    out = _run("hf_model.py", "--max-steps", "4", "--num-samples", "200", "--max-tokens", "256", cwd=tmp_path)
    error = re.search(r"isolation: (\d+) documents packed .* alone up to ([\d.e+-]+)", out)
    assert error is not None and int(error[1]) > 1 and float(error[2]) <= 1e-4
    assert re.search(r"^HF Llama packed: 4 steps in", out, re.M)


def test_compare_modes_trains_each_mode_on_the_same_real_tokens(tmp_path):
    out = _run(
        "compare_modes.py",
        "--real-tokens",
        "3000",
        "--",
        "--data.source.init_args.num_samples=300",
        "--data.max_tokens=256",
        "--data.source.init_args.max_length=128",
        cwd=tmp_path,
    )
    assert list(tmp_path.iterdir()) == []  # a comparison writes no config, log or checkpoint
    rows = {m[1]: m for m in re.finditer(r"^(packing|dynamic|padded)\s+(\d+)\s+([\d,]+)\s+([\d.]+)%", out, re.M)}
    assert set(rows) == {"packing", "dynamic", "padded"}, out[-2000:]
    for row in rows.values():
        assert 3000 <= int(row[3].replace(",", "")) < 3000 + 1024  # stops within a microbatch of the budget
    assert float(rows["padded"][4]) > float(rows["dynamic"][4]) > float(rows["packing"][4])


def _stdout(script: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _gradient_error(out: str) -> float:
    """The figure on the last line of the script's output (what ``--check`` promises)."""
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"max relative gradient error vs one big padded batch: ([\d.e+-]+)", last)
    assert match is not None, out[-2000:]
    return float(match[1])


def test_grpo_example_matches_one_big_padded_batch(tmp_path):
    out = _stdout("grpo.py", "--rollouts", "2", "--check", cwd=tmp_path)
    assert re.search(r"^GRPO: 2 rollouts, 4 optimizer steps, final loss -?[\d.]+$", out, re.M), out[-2000:]
    assert _gradient_error(out) <= 1e-5


def test_grpo_example_resumes_between_rollouts_exactly(tmp_path):
    out = _stdout("grpo.py", "--rollouts", "2", "--prompts", "4", "--resume-check", cwd=tmp_path)
    match = re.search(r"^max weight difference, resumed after rollout 0 vs straight: ([\d.e+-]+)$", out, re.M)
    assert match is not None and float(match[1]) <= 1e-6, out[-2000:]
    first = _stdout(
        "grpo.py", "--rollouts", "2", "--prompts", "4", "--ckpt-dir", "ckpt", "--stop-after", "1", cwd=tmp_path
    )
    assert re.search(r"^GRPO: 1 rollouts, 2 optimizer steps", first, re.M) and (tmp_path / "ckpt/last.ckpt").exists()
    resumed = _stdout("grpo.py", "--rollouts", "2", "--prompts", "4", "--ckpt-dir", "ckpt", cwd=tmp_path)
    assert re.search(r"^GRPO: 2 rollouts, 4 optimizer steps", resumed, re.M), resumed[-2000:]


def test_ppo_example_matches_one_big_padded_batch(tmp_path):
    out = _stdout("ppo.py", "--rollouts", "2", "--check", cwd=tmp_path)
    assert re.search(r"^PPO: 2 rollouts, 4 optimizer steps, final loss -?[\d.]+$", out, re.M), out[-2000:]
    assert _gradient_error(out) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("script", ["grpo.py", "ppo.py"])
def test_rl_examples_match_one_big_padded_batch_on_two_ranks(script, tmp_path):
    out = _stdout(script, "--devices", "2", "--rollouts", "2", "--check", cwd=tmp_path)
    assert re.search(r"^(GRPO|PPO): 2 rollouts, 4 optimizer steps", out, re.M), out[-2000:]
    assert _gradient_error(out) <= 1e-5


@pytest.mark.slow
def test_dpo_example_matches_one_big_padded_batch_on_two_ranks(tmp_path):
    out = _stdout("dpo.py", "--devices", "2", "--max-steps", "2", "--check", cwd=tmp_path)
    assert re.search(r"^DPO: 24 pairs, 2 optimizer steps, final loss [\d.]+$", out, re.M), out[-2000:]
    assert _gradient_error(out) <= 1e-5
