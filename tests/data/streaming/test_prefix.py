"""``lit-seqpack inspect`` on a stream split by rank reports what the real training loaders yield: the microbatches
per rank (lock step), each rank's empty ones and the packing efficiency, with 2 ranks simulated by threads."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lit_seqpack import SeqPackDataModule
from lit_seqpack.__main__ import inspect_command
from lit_seqpack.data.sources import JsonlStream
from lit_seqpack.data.streaming.pipeline import share_sizes
from lit_seqpack.parallel import DataParallelLayout
from tests._limits import TEST_TIMEOUT_S
from tests.data.streaming.test_lockstep import ThreadGather, _run

pytestmark = pytest.mark.timeout(TEST_TIMEOUT_S)

WORLD, ACCUMULATE, MAX_TOKENS, WINDOW, VOCAB = 2, 2, 128, 24, 50
# rank 0's share (the first half of the files' bytes) holds few tokens: the first file's lines are short samples with
# a long note, so rank 0 runs lock-step fillers while rank 1 trains
SIZES = [[3 + n % 11 for n in range(120)], [20 + n * 37 % 90 for n in range(60)]]
NOTES = [300, 0]


def _stream(tmp_path: Path) -> Path:
    for part, sizes in enumerate(SIZES):
        lines = [
            json.dumps({"input_ids": [1 + (n + k) % (VOCAB - 1) for k in range(size)], "note": "x" * NOTES[part]})
            for n, size in enumerate(sizes)
        ]
        (tmp_path / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def _module(folder: Path, **kwargs: Any) -> SeqPackDataModule:
    settings = {"window": WINDOW, "max_tokens": MAX_TOKENS, "num_workers": 0, "stream_split": "rank"} | kwargs
    return SeqPackDataModule(source=JsonlStream(str(folder), vocab_size=VOCAB), **settings)


def _train(folder: Path) -> list[list[dict[str, Any]]]:
    """Every rank's batches from the DataModule's own training loader, the lock step's collective simulated."""

    def drain(rank: int, gather: ThreadGather) -> list[dict[str, Any]]:
        pipeline = _module(folder).pipeline
        pipeline.layout = DataParallelLayout(WORLD, rank, ACCUMULATE)
        loader = pipeline.train_loader()
        loader.gather = gather.of(rank)
        return list(loader)

    return _run(WORLD, drain)


def _inspect(folder: Path, *argv: str) -> str:
    return inspect_command(
        [
            "--data.source=lit_seqpack.data.sources.JsonlStream",
            f"--data.source.init_args.paths={folder}",
            f"--data.source.init_args.vocab_size={VOCAB}",
            f"--data.max_tokens={MAX_TOKENS}",
            f"--data.window={WINDOW}",
            f"--world_size={WORLD}",
            f"--accumulate_grad_batches={ACCUMULATE}",
            *argv,
        ]
    )


def test_inspect_of_a_stream_split_by_rank_reports_what_the_training_loaders_yield(tmp_path: Path) -> None:
    folder = _stream(tmp_path)
    per_rank = _train(folder)
    assert not any(isinstance(batches, Exception) for batches in per_rank), per_rank
    trained = len(per_rank[0])
    assert {len(batches) for batches in per_rank} == {trained}  # lock step
    empty = [sum(bool(b["is_empty"]) for b in batches) for batches in per_rank]
    assert empty[0] > empty[1]  # the short share fills
    real = sum(int(b["num_real_tokens"]) for batches in per_rank for b in batches)

    report = _inspect(folder, "--max_samples=1000")  # more than the stream: the whole of each share
    line = next(line for line in report.splitlines() if line.startswith("stream: JsonlStream"))
    assert f"first {sum(map(len, SIZES))} samples of 2 rank shares (stream_split='rank'" in line
    assert f"train them in {trained} microbatches a rank in lock step" in line
    shares = next(line for line in report.splitlines() if line.startswith("stream shares: "))
    for rank, batches in enumerate(per_rank):
        documents = sum(int(b["num_documents"]) for b in batches)
        assert f"rank {rank}: {documents} samples, {empty[rank]} of {trained} microbatches empty" in shares
    efficiency = float(re.search(r"efficiency (\d\.\d{4})", shares).group(1))
    assert efficiency == pytest.approx(real / (WORLD * trained * MAX_TOKENS), abs=5e-5)

    replicated = _inspect(folder, "--max_samples=1000", "--data.stream_split=replicate")
    assert "stream shares: " not in replicated and "microbatches a rank (the offline plan below" in replicated


def test_the_prefix_of_a_stream_split_by_rank_is_the_start_of_each_share(tmp_path: Path) -> None:
    folder = _stream(tmp_path)
    pipeline, layout = _module(folder).pipeline, DataParallelLayout(WORLD, 0, ACCUMULATE)
    lengths, _ = pipeline.prefix(7, layout)
    assert share_sizes(7, WORLD) == [4, 3]
    shares = [[len(s["input_ids"]) for s in JsonlStream(str(folder)).split(r, WORLD).open()] for r in range(WORLD)]
    assert shares[1][0] != SIZES[0][4]  # rank 1's share starts inside the first file, at its middle byte
    assert lengths.tolist() == shares[0][:4] + shares[1][:3]  # each rank's first samples, not the stream's first 7
    assert pipeline.prefix(7)[0].tolist() == SIZES[0][:7]  # one rank (or replicate): the stream's first samples
    lock = pipeline.prefix_lock_step(7, layout)
    assert [share.samples for share in lock.shares] == [4, 3]
    assert lock.microbatches_per_rank == max(share.steps for share in lock.shares) * ACCUMULATE
