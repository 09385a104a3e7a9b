"""Benchmark one rank's stream loader by ``num_workers``: under ``stream_split="rank"`` 2 or more workers read lanes.

Writes ``--samples`` lognormal samples (median ``--median`` tokens) as 4 JSONL shards, then drains the training loader
of ``SeqPackDataModule(source=JsonlStream(...))`` on one rank for each ``--workers`` count, and prints one Markdown
row each: wall seconds, samples/s, and the CPU seconds of the main process and of the workers (``getrusage`` of the
reaped worker processes). Each worker reads only its lane, so the workers' CPU stays about that of one pass over the
stream whatever the count (before lanes, every worker parsed the whole share).

Usage::

    .venv/bin/python benchmarks/bench_stream_lanes.py --samples 40000 --workers 0 2
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import JsonlStream


def write_shards(folder: Path, samples: int, median: int, seed: int = 0) -> None:
    """``samples`` lognormal-length samples in 4 JSONL shards under ``folder``."""
    rng = np.random.default_rng(seed)
    for shard in range(4):
        with open(folder / f"part-{shard}.jsonl", "w") as handle:
            for _ in range(samples // 4):
                length = int(np.clip(rng.lognormal(np.log(median), 1.0), 2, 4000))
                handle.write(json.dumps({"input_ids": rng.integers(1, 500, length).tolist()}) + "\n")


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def drain(folder: Path, workers: int, samples: int) -> str:
    """One Markdown row: the training loader of one rank drained with ``workers`` loader workers."""
    data = SeqPackDataModule(
        source=JsonlStream(str(folder), vocab_size=512), window=1000, max_tokens=8192, num_workers=workers
    )
    main, children, start = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    batches = sum(1 for _ in data.train_dataloader())
    wall = time.perf_counter() - start
    main, children = _cpu(resource.RUSAGE_SELF) - main, _cpu(resource.RUSAGE_CHILDREN) - children
    return f"| {workers} | {batches:,} | {wall:.2f} | {samples / wall:,.0f} | {main:.2f} | {children:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        write_shards(Path(folder), args.samples, args.median)
        print("| num_workers | microbatches | wall s | samples/s | main CPU s | workers CPU s |")
        print("|---|---|---|---|---|---|")
        for workers in args.workers:
            print(drain(Path(folder), workers, args.samples), flush=True)


if __name__ == "__main__":
    main()
