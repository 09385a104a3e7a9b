"""benchmarks/bench_scale.py runs end to end at a tiny size and prints its three tables (no timing is asserted).

One run covers the whole script, the rank table included (each of its rows plans in a fresh interpreter, ~5 s of
imports): 2 ranks (the plan packs tightly) and 4096 ranks (one step an epoch), through the sampler and the DataModule.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def _tables(stdout: str) -> list[list[list[str]]]:
    tables, current = [], []
    for line in [*stdout.splitlines(), ""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            tables.append([current[0], *current[2:]])  # the header, then the rows (the rule dropped)
            current = []
    return tables


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_bench_scale_prints_the_planning_and_loader_tables() -> None:
    # 200k sequences: enough for the planner's memory to rise above the allocator's reuse of the warm-up's (at 20k
    # the peak above the warm-up was 0-1 byte a sequence under torch 2.14's CUDA wheel, 69 under 2.13's CPU wheel)
    command = [sys.executable, "benchmarks/bench_scale.py", "--sequences", "200000", "--tokens", "256"]
    command += ["--rank-worlds", "2", "4096", "--steps", "1", "--workers", "0", "1", "--threads", "1"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    plan, rank, loader = _tables(result.stdout)
    assert plan[0] == ["mode", "seconds", "peak MiB", "peak B/seq", "plan B/seq", "microbatches", "utilization"]
    assert [row[0] for row in plan[1:]] == ["packing", "dynamic", "padded"]
    assert all(float(row[3]) > 0 for row in plan[1:])  # planning 200k sequences takes some memory
    assert [row[0] for row in rank[1:]] == [f"200,000 x {w} ({p})" for w in (2, 4096) for p in ("sampler", "dm")]
    utilization, peak = rank[0].index("utilization"), rank[0].index("peak B/sample")
    assert all(float(row[utilization]) > 0.9 for row in rank[1:3])  # 2 ranks: 200k samples pack tightly
    assert all(float(row[peak]) > 0 for row in rank[1:])  # peak bytes per sample
    assert [row[0] for row in loader[1:]] == ["demo, 0 worker(s)", "demo, 1 worker(s)"]
    assert all(row[3].endswith("%") and int(row[4]) <= 256 for row in loader[1:])
