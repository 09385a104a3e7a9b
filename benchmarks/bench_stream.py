"""Benchmark streaming against the offline plan: packing efficiency and loader throughput per buffer size.

Two Markdown tables on lognormal lengths (``--median`` tokens, shape ``--sigma``, at most ``--max-tokens``):

1. Packing: the offline plan of the whole data (``build_plan``, best fit decreasing) against the stream packed in
   windows of ``--buffers`` samples (``stream_windows``, the least-full rows carried to the next window), both for
   ``--world`` ranks x ``--accumulate``. Columns: microbatches over all ranks (fillers included), efficiency = real
   tokens / (microbatches x max_tokens), streamed / offline efficiency, lock-step fillers, samples carried, planning
   seconds (the stream's include generating its samples).
2. Loader: one rank's DataLoader end to end (read, plan, collate into packed rows; ``num_workers=0``), the map-style
   DataModule on the samples in memory against ``SeqPackDataModule(source=SyntheticStream(...))``: microbatches/s
   and real tokens/s, and the loader's peak Python memory (``tracemalloc``; the map-style loader holds the data).
3. Read path: CPU microseconds per sample over one JSONL file of ``--read-samples`` generated samples, side by side in
   one run (best of ``--repeats`` interleaved passes): the floor (each line read and ``json.loads``-ed, nothing else),
   ``JsonlStream``'s reader alone, the reader with the stream's own per-sample work (token lists converted and checked,
   the over-long policy, windows of 1,000 samples planned: what a stream adds before collation), and the whole stream
   loader to collated microbatches (``num_workers=0``, one rank; collation is the same as map-style data's), each
   also as a multiple of the floor.

    .venv/bin/python benchmarks/bench_stream.py            # 200k samples for packing, 20k through the loaders
    .venv/bin/python benchmarks/bench_stream.py --quick    # 20k and 4k (4k through the read path)
    .venv/bin/python benchmarks/bench_stream.py --only-read-path    # the read-path table alone
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from _common import machine_summary, markdown_table

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import JsonlStream, SyntheticStream
from lit_seqpack.data.streaming import OverlongCounter, stream_windows
from lit_seqpack.planning.plan import PlanConfig, build_plan


def _config(args: argparse.Namespace) -> PlanConfig:
    return PlanConfig(
        mode="packing",
        max_tokens=args.max_tokens,
        algorithm="best_fit_decreasing",
        world_size=args.world,
        accumulate_grad_batches=args.accumulate,
        seed=0,
    )


def _stream(args: argparse.Namespace, count: int) -> SyntheticStream:
    return SyntheticStream(
        num_samples=count,
        vocab_size=512,
        median_length=args.median,
        sigma=args.sigma,
        max_length=args.max_tokens,
        seed=0,
    )


def packing_table(args: argparse.Namespace) -> str:
    config, stream = _config(args), _stream(args, args.samples)
    lengths = np.array([len(s["input_ids"]) for s in stream.open()], dtype=np.int64)
    tokens = int(lengths.sum())
    start = time.perf_counter()
    offline = build_plan(lengths, config, epoch=0).stats
    rows = [["offline plan", "-", f"{offline.num_microbatches:,}", f"{offline.utilization:.4f}", "1.0000",
             f"{offline.num_empty_microbatches}", "-", f"{time.perf_counter() - start:.2f}"]]  # fmt: skip
    for buffer in args.buffers:
        start = time.perf_counter()
        microbatches = empty = carried = 0
        for window in stream_windows(stream.open(), config=config, window_size=buffer, epoch=0):
            microbatches += window.plan.stats.num_microbatches
            empty += window.plan.stats.num_empty_microbatches
            carried += len(window.carried_in)
        efficiency = tokens / (microbatches * args.max_tokens)
        rows.append(["stream", f"{buffer:,}", f"{microbatches:,}", f"{efficiency:.4f}",
                     f"{efficiency / offline.utilization:.4f}", f"{empty}", f"{carried:,}",
                     f"{time.perf_counter() - start:.2f}"])  # fmt: skip
    headers = ["plan", "buffer", "microbatches", "efficiency", "vs offline", "fillers", "carried", "seconds"]
    title = (
        f"Packing {args.samples:,} samples ({tokens:,} tokens; lognormal median {args.median}, sigma {args.sigma}), "
        f"max_tokens {args.max_tokens}, {args.world} ranks x accumulate {args.accumulate}"
    )
    return f"{title}\n\n{markdown_table(headers, rows)}"


def _drain(make_loader: Callable[[], Iterable[dict[str, Any]]]) -> tuple[float, int, int, float]:
    """Seconds, microbatches and real tokens of one pass, and the peak traced memory (MiB) of building + passing."""
    tracemalloc.start()
    try:
        start = time.perf_counter()
        microbatches = tokens = 0
        for batch in make_loader():
            microbatches += 1
            tokens += int(batch["num_real_tokens"])
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return seconds, microbatches, tokens, peak / 2**20


def loader_table(args: argparse.Namespace) -> str:
    count = args.loader_samples
    common = {"max_tokens": args.max_tokens, "algorithm": "best_fit_decreasing", "num_workers": 0, "seed": 0}

    def offline() -> Iterable[dict[str, Any]]:
        data = list(_stream(args, count).open())  # a map-style dataset must exist in memory (or on disk) first
        return SeqPackDataModule(source=data, **common, content_check_samples=0).train_dataloader()

    def streamed(buffer: int) -> Callable[[], Iterable[dict[str, Any]]]:
        return lambda: SeqPackDataModule(source=_stream(args, count), **common, window=buffer).train_dataloader()

    rows = []
    for name, buffer, make in [("offline (map-style)", "-", offline)] + [
        ("stream", f"{b:,}", streamed(b)) for b in args.buffers
    ]:
        seconds, microbatches, tokens, peak = _drain(make)
        rows.append([name, buffer, f"{microbatches:,}", f"{microbatches / seconds:,.0f}", f"{tokens / seconds:,.0f}",
                     f"{peak:.1f}"])  # fmt: skip
    headers = ["loader", "buffer", "microbatches", "microbatches/s", "real tokens/s", "peak MiB"]
    title = f"One rank's loader over {count:,} samples (read + plan + collate, num_workers=0)"
    return f"{title}\n\n{markdown_table(headers, rows)}"


def read_path_table(args: argparse.Namespace) -> str:
    count = args.read_samples
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/stream.jsonl"
        with open(path, "w") as handle:
            handle.writelines(json.dumps(sample) + "\n" for sample in _stream(args, count).open())

        def floor() -> int:
            with open(path, "rb") as lines:
                return sum(1 for line in lines if json.loads(line))

        def reader() -> int:
            return sum(1 for _ in JsonlStream(path).open())

        def windows() -> int:  # what a stream adds before collation: each sample checked, counted, planned
            counter = OverlongCounter(policy="error", max_tokens=args.max_tokens)
            planned = stream_windows(
                JsonlStream(path).open(), config=config, window_size=1_000, epoch=0, counter=counter
            )
            return sum(len(window.samples) + 0 * window.plan.microbatches_per_rank for window in planned)

        def loader() -> int:
            settings = {"max_tokens": args.max_tokens, "algorithm": "best_fit_decreasing", "num_workers": 0, "seed": 0}
            module = SeqPackDataModule(source=JsonlStream(path, vocab_size=512), window=1_000, **settings)
            return sum(int(batch["num_documents"]) for batch in module.train_dataloader())

        config = PlanConfig(mode="packing", max_tokens=args.max_tokens, algorithm="best_fit_decreasing", seed=0)
        stages = {
            "json.loads of each line (floor)": floor,
            "JsonlStream reader": reader,
            "reader + windows (checked, planned)": windows,
            "stream loader (collated microbatches)": loader,
        }
        best = dict.fromkeys(stages, float("inf"))
        for _ in range(args.repeats):  # interleaved, so a busy machine slows every stage alike
            for name, stage in stages.items():
                start = time.process_time()  # CPU time: steadier than wall time on a shared machine
                assert stage() == count, name
                best[name] = min(best[name], time.process_time() - start)
    floor_us = best["json.loads of each line (floor)"] / count * 1e6
    rows = [[name, f"{seconds / count * 1e6:.1f}", f"{seconds / count * 1e6 / floor_us:.2f}"]
            for name, seconds in best.items()]  # fmt: skip
    title = (
        f"Read path over one JSONL file of {count:,} samples (lognormal median {args.median}, with labels), "
        f"best of {args.repeats}"
    )
    return f"{title}\n\n{markdown_table(['stage', 'CPU us / sample', 'x floor'], rows)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="samples of the packing table")
    parser.add_argument("--loader-samples", type=int, default=20_000, help="samples through the loaders")
    parser.add_argument("--read-samples", type=int, default=20_000, help="samples of the read-path table")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes of the read-path table")
    parser.add_argument("--only-read-path", action="store_true", help="print the read-path table alone")
    parser.add_argument("--buffers", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="20k samples for packing, 4k through the loaders")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.loader_samples, args.read_samples = 20_000, 4_000, 4_000
    print(machine_summary())
    print()
    if not args.only_read_path:
        print(packing_table(args))
        print()
        print(loader_table(args))
        print()
    print(read_path_table(args))


if __name__ == "__main__":
    main()
