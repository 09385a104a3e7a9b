"""The training benchmarks run end to end at a tiny size and print what they promise (no timing is asserted)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _common import fair_batch_size, markdown_table, matched_accumulation  # noqa: E402

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)  # most tests run a benchmark in a subprocess

MODES = [
    "padded",
    "padded, other order",
    "dynamic",
    "packing concatenative",
    "packing first_fit_decreasing",
    "packing first_fit_shuffle",
    "packing modified_first_fit_decreasing",
    "packing best_fit_decreasing",
]


def _run(script: str, *args: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()


def _tables(lines: list[str]) -> list[list[list[str]]]:
    """Every Markdown table in ``lines`` as rows of stripped cells (header first, the rule line dropped)."""
    tables, current = [], []
    for line in [*lines, ""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            tables.append([current[0], *current[2:]])
            current = []
    return tables


def test_bench_train_smoke_prints_tables_and_the_headline():
    lines = _run("bench_train.py", "--smoke")
    assert re.fullmatch(r"packed/padded real-token throughput: \d+\.\d\dx", lines[-1]), lines[-1]
    assert re.fullmatch(r"packed/dynamic real-token throughput: \d+\.\d\dx", lines[-3]), lines[-3]
    assert re.fullmatch(r"packed/dynamic .* by CPU time \(maskless dynamic\): \d+\.\d\dx", lines[-4]), lines[-4]
    maskless = [re.search(r"needed a mask: (\d+) of (\d+)\.", line) for line in lines if "needed a mask" in line]
    assert len(maskless) == 2 and all(m and m[1] == "0" and int(m[2]) > 0 for m in maskless), maskless
    tables = _tables(lines)
    assert len(tables) == 4  # throughput + loss, for each of the two profiles
    for throughput, losses in (tables[0:2], tables[2:4]):
        assert throughput[0][:3] == ["mode", "accum", "opt steps"]
        assert [row[0] for row in throughput[1:]] == MODES
        assert [row[0] for row in losses[1:]] == MODES
        by_mode = {row[0]: dict(zip(throughput[0], row, strict=True)) for row in throughput[1:]}
        assert by_mode["padded"]["x padded"] == "1.00x" and by_mode["dynamic"]["x dynamic (CPU)"] == "1.00x"
        for name in MODES:
            assert float(by_mode[name]["real tok/s"].replace(",", "")) > 0
            for column in ("x padded (CPU)", "x dynamic", "x dynamic (CPU)"):
                assert re.fullmatch(r"\d+\.\d\dx", by_mode[name][column])
        assert all(by_mode[name]["padding"] == "0.0%" for name in MODES if name.startswith("packing"))
        assert float(by_mode["padded"]["padding"].rstrip("%")) > 10  # the baseline pads, packing does not
        for row in losses[1:]:
            assert all(0 < float(value) < 10 for value in row[1:-1])  # held-out losses, finite and plausible
    assert sum(line.startswith("target ") for line in lines) == 8


def test_bench_train_masked_rows_build_the_dense_mask(monkeypatch):
    import torch
    from bench_train import build_module, force_dense_mask

    from lit_seqpack.data.batching.collate import PaddedCollator
    from lit_seqpack.model.reference import ReferenceDecoder

    built = []
    dense = ReferenceDecoder._dense_mask
    monkeypatch.setattr(ReferenceDecoder, "_dense_mask", staticmethod(lambda *a: built.append(1) or dense(*a)))
    torch.manual_seed(0)
    module = build_module("reference", preset="tiny", vocab_size=128, max_seq_len=64, lr=1e-3)
    batch = PaddedCollator()([{"input_ids": torch.arange(1, n + 1)} for n in (5, 9, 3)])
    maskless = module.training_step(batch, 0)
    assert built == []
    force_dense_mask(module)
    masked = module.training_step(batch, 1)
    assert built == [1]  # one mask a forward, shared by the layers
    torch.testing.assert_close(masked, maskless)  # the same loss: right padding needs no mask


def test_gpu_script_code_path_on_cpu(tmp_path):
    out = tmp_path / "results" / "gpu.json"
    lines = _run("gpu.py", "--device", "cpu", "--tiny", "--out", str(out))
    assert "optional packages imported by lit_seqpack's model, data and planning modules: none" in lines
    attention, training = _tables(lines)
    assert {row[0] for row in attention[1:]} >= {"varlen sdpa", "dense mask", "padded", "padded + mask"}
    modes = ["padded", "dynamic", "packing sdpa", "no-padding bound"]
    assert [row[0] for row in training[1:]] == [*modes[:3], "packing flex", modes[3]]
    assert lines[-1].startswith("| no-padding bound")  # the training table is printed last
    assert any("microbatches that needed a mask: 0)" in line for line in lines)
    by_mode = {row[0]: dict(zip(training[0], row, strict=True)) for row in training[1:]}
    assert all(float(by_mode[m]["real tok/s"].replace(",", "")) > 0 for m in modes)
    assert [by_mode[m]["status"] for m in modes] == ["ok", "ok", "ok", "ok (attention: sdpa)"]
    # the flex row is there, refused by name on a CPU (no FlexAttention backward); it trains on CUDA
    assert by_mode["packing flex"]["status"].startswith("refused: BackendUnavailableError: attention backend 'flex'")
    assert by_mode["packing flex"]["real tok/s"] == "n/a"
    assert by_mode["padded"]["x padded"] == by_mode["no-padding bound"]["x bound"] == "1.00x"
    assert by_mode["no-padding bound"]["padding"] == "0.0%" and by_mode["no-padding bound"]["held-out loss"] == "n/a"
    report = json.loads(out.read_text())
    assert [row["mode"] for row in report["training"]["rows"]] == [*modes[:3], "packing flex", modes[3]]
    assert report["training"]["flops_per_real_token"] > 0 and report["training"]["peak_flops"] is None
    assert {row["layout"] for row in report["attention"]} >= {"padded", "padded + mask"}


def test_gpu_rounds_drop_a_failing_mode_and_keep_the_others():
    from _gpu_rows import train_rounds

    class Run:
        def __init__(self, fails: bool) -> None:
            self.fails, self.marks, self.module = fails, [], object()
            self.optimizer = self.scheduler = object()

        def train_until(self, mark: int) -> None:
            if self.fails:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore details")
            self.marks.append(mark)

    runs = {"padded": Run(False), "packing flash_attn": Run(True), "dynamic": Run(False)}
    failed, done = train_rounds(runs, total=300, rounds=3, deadline=float("inf"))
    assert failed == {"packing flash_attn": "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    assert done == 3 and runs["padded"].marks == runs["dynamic"].marks == [100, 200, 300]
    assert runs["packing flash_attn"].module is None  # released
    assert train_rounds({"padded": Run(False)}, total=300, rounds=3, deadline=0.0) == ({}, 0)


@pytest.mark.slow
def test_gpu_tests_collect_without_hypothesis(monkeypatch):
    """The GPU machine may lack hypothesis: a stub lets the files that import it be collected, and none errors."""
    import importlib.util

    import _gpu_rows

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "hypothesis" else find_spec(name, *a)
    )
    report = _gpu_rows.run_gpu_tests(ROOT, timeout=600)
    assert report["returncode"] == 0, report["tail"]
    assert re.search(r"\d+ (passed|skipped)", report["summary"]) and "error" not in report["summary"], report["summary"]


def test_gpu_tests_are_found_by_their_marker():
    from _gpu_rows import gpu_test_files

    files = {path.relative_to(ROOT).as_posix() for path in gpu_test_files(ROOT)}
    assert {"tests/model/test_attention.py", "tests/model/test_padding.py"} <= files
    assert "tests/test_benchmarks.py" not in files


def test_model_and_data_modules_import_no_config_packages():
    modules = [
        "lit_seqpack.model.attention",
        "lit_seqpack.model.reference",
        "lit_seqpack.model.loss",
        "lit_seqpack.model.mixin",
        "lit_seqpack.model.hf",
        "lit_seqpack.model.lm",
        "lit_seqpack.data.batching.collate",
        "lit_seqpack.data.indexed.planned_sampler",
        "lit_seqpack.batch",
        "lit_seqpack.planning.plan",
    ]
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'omegaconf', 'jsonargparse', 'torchdata'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_fair_batch_size_is_the_largest_within_the_budget():
    lengths = np.random.default_rng(0).integers(8, 500, size=400)
    batch_size, mean = fair_batch_size(lengths, 1024, seed=0)
    assert mean <= 1024
    assert fair_batch_size(lengths, math.ceil(mean), seed=0)[0] == batch_size
    assert fair_batch_size(lengths, math.ceil(mean) - 1, seed=0)[0] == batch_size - 1
    larger, larger_mean = fair_batch_size(lengths, 10**9, seed=0)
    assert larger == len(lengths) and larger_mean > 1024


def test_matched_accumulation_and_table_layout():
    assert matched_accumulation({"padded": 700.0, "dynamic": 1900.0, "packing": 2000.0}, "packing") == {
        "padded": 3,
        "dynamic": 1,
        "packing": 1,
    }
    table = markdown_table(["mode", "value"], [["a", "1"], ["long name", "22"]]).splitlines()
    assert table == ["| mode      | value |", "|:----------|------:|", "| a         |     1 |", "| long name |    22 |"]


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--max-tokens", "64"]])
def test_bench_train_rejects_bad_sizes(bad):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_train.py"), "--smoke", *bad], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert bad[0] in result.stderr


def test_bench_plan_balance_table_smoke():
    """The balance table of bench_plan (bench_scale's rank table is checked in tests/reliability/test_bench_scale)."""
    lines = _run("bench_plan.py", "--only", "balance", "--compare-size", "3000", "--world", "2")
    (balance,) = _tables(lines)
    settings = [row[3] for row in balance[1:]]
    assert settings[:2] == ["0.0", "auto"] and len(balance) == 1 + 24


def test_bench_collate_table_smoke():
    lines = _run("bench_collate.py", "--rows", "3", "--repeats", "1", "--max-tokens", "512", "--threads", "1", "2")
    (table,) = _tables(lines)
    assert [(row[0], row[1]) for row in table[1:]] == [
        ("packed", "1"),
        ("packed", "2"),
        ("per-document pad 8", "1"),
        ("per-document pad 8", "2"),
    ]
    assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in table[1:])


def test_bench_stream_prints_the_packing_loader_read_path_and_ranks_tables():
    args = ["--samples", "3000", "--loader-samples", "300", "--buffers", "100", "1000", "--median", "256"]
    args += ["--read-samples", "300", "--repeats", "1", "--worlds", "2", "--simulated", "3", "--rank-samples", "300"]
    packing, loader, read_path, ranks = _tables(_run("bench_stream.py", *args))
    assert [row[:2] for row in packing[1:]] == [["offline plan", "-"], ["stream", "100"], ["stream", "1,000"]]
    offline, small, large = (float(row[3]) for row in packing[1:])
    assert 0 < small <= large <= 1 and large >= 0.95 * offline  # more look-ahead packs at least as well
    assert [row[0] for row in loader[1:]] == ["offline (map-style)", "stream", "stream"]
    assert all(float(row[3].replace(",", "")) > 0 for row in loader[1:])
    assert [row[0] for row in read_path[1:]] == [
        "json.loads of each line (floor)",
        "JsonlStream reader",
        "reader + windows (checked, planned)",
        "stream loader (collated microbatches)",
        "ParquetStream reader (same rows)",
        "Parquet stream loader",
    ]
    assert float(read_path[1][2]) == 1.0 and all(float(row[1]) > 0 for row in read_path[1:])
    assert [row[:2] for row in ranks[1:]] == [["2", "replicate"], ["2", "rank"], ["3 (threads)", "rank"]]
    assert all(float(row[2]) > 0 and 0 < float(row[4]) <= 1 for row in ranks[1:])  # CPU per token, efficiency


def test_bench_rl_prints_the_balance_table_with_rl_at_the_bound():
    lines = _run("bench_rl.py", "--samples", "256", "--ranks", "4", "--steps", "2", "--repeats", "2")
    rows = [line for line in lines if line.startswith("| 256 ")]
    assert len(rows) == 2, lines  # the balance table, then the timing table against NeMo-RL
    cells = [cell.strip(" \\") for cell in rows[0].strip("|").split("|")]  # "tokens \| cost" pairs split too
    round_robin_cost, rl_cost, bound = float(cells[3]), float(cells[7]), float(cells[8])
    assert bound <= rl_cost <= 1.01 and rl_cost < round_robin_cost
    timed = [cell.strip(" \\") for cell in rows[1].strip("|").split("|")]
    assert timed[2].endswith(" ms") and timed[3].endswith(" ms") and timed[4].endswith("x")
    assert float(timed[6]) == pytest.approx(rl_cost, abs=1e-4) and float(timed[8]) >= float(timed[6])


def test_memory_benchmark_runs_tiny_and_compares_the_loss_paths() -> None:
    lines = _run("bench_memory.py", "--tokens", "128", "--vocab", "512", "--chunks", "32", "--models", "reference")
    (table,) = _tables(lines)
    assert [row[:2] for row in table[1:]] == [["ReferenceLM", "full logits"], ["ReferenceLM", "chunked 32"]]
    assert any("loss and gradients exact" in line for line in lines), lines[-3:]
