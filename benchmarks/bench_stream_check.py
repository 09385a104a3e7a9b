"""Benchmark the cost of the streams' cross-rank check: the per-window digest against reading and planning the window.

Each window of a stream gets a digest in its loader worker (:func:`~lit_seqpack.data.streaming.rank_check.
window_digest`: all lengths and loss tokens, the tokens of ``content_check_samples`` samples); the comparison itself
is one ``all_gather_object`` every 8 windows, not timed here. A Markdown table per buffer size on lognormal lengths
(median 128, sigma 1, at most 2048 tokens; 2 ranks x accumulate 2, best fit decreasing).

    .venv/bin/python benchmarks/bench_stream_check.py
"""

from __future__ import annotations

import argparse
import time

from _common import machine_summary, markdown_table

from lit_seqpack.data.sources import SyntheticStream
from lit_seqpack.data.streaming.buffer import stream_windows
from lit_seqpack.data.streaming.rank_check import window_digest
from lit_seqpack.planning.plan import PlanConfig


def measure(buffer: int, samples: int, check_samples: int) -> list[str]:
    """One row: windows, milliseconds a window to read and plan it, to digest it, and the digest's share."""
    stream = SyntheticStream(num_samples=samples, median_length=128, sigma=1.0, max_length=2048)
    config = PlanConfig(max_tokens=2048, world_size=2, accumulate_grad_batches=2, algorithm="best_fit_decreasing")
    start = time.perf_counter()
    windows = list(stream_windows(stream.open(), config=config, window_size=buffer, epoch=0))
    planned = (time.perf_counter() - start) / len(windows)
    start = time.perf_counter()
    for window in windows:
        window_digest(window, epoch=0, samples=check_samples)
    digested = (time.perf_counter() - start) / len(windows)
    share = f"{digested / planned:.2%}"
    return [f"{buffer:,}", f"{len(windows):,}", f"{planned * 1e3:.2f}", f"{digested * 1e3:.3f}", share]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--buffers", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--check-samples", type=int, default=8)
    args = parser.parse_args()
    print(machine_summary())
    headers = ["buffer", "windows", "read + plan ms/window", "digest ms/window", "digest share"]
    print(markdown_table(headers, [measure(b, args.samples, args.check_samples) for b in args.buffers]))


if __name__ == "__main__":
    main()
