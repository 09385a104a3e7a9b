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

4. Ranks: ``--worlds`` real gloo ranks (one process each, ``num_workers=0``, one torch thread) drain the training
   loader of ``StreamPipeline`` on ``--rank-samples`` samples written as JSONL shards, for ``stream_split``
   ``replicate`` (every rank reads the whole stream) and ``rank`` (each rank reads its share, one collective a
   window). Columns: CPU us per trained token per rank (each rank's process CPU time over the real tokens it
   trained, the mean over ranks; the 1-rank figure is the floor), cluster real tokens/s (all ranks' tokens over
   the slowest rank's wall time), packing efficiency (real tokens / (microbatches x max_tokens) over all ranks,
   fillers included) against the offline plan of the same samples for the same layout, and the worst and the mean
   per-step token imbalance over ranks (max / mean real tokens of one optimizer step; the steps where some rank
   only fills after its share ended are counted apart). Each rank is measured after one warm-up batch (imports,
   cached planner kernels). ``--simulated`` adds ``rank`` rows for more ranks run as threads of one process.

    .venv/bin/python benchmarks/bench_stream.py            # 200k samples for packing, 20k through the loaders
    .venv/bin/python benchmarks/bench_stream.py --quick    # 20k and 4k (4k through the read path)
    .venv/bin/python benchmarks/bench_stream.py --only read-path    # the read-path table alone
    .venv/bin/python benchmarks/bench_stream.py --only ranks --worlds 1 2 4 --rank-samples 6000 --max-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from _common import machine_summary, markdown_table

from lit_seqpack import SeqPackDataModule
from lit_seqpack.data.sources import JsonlStream, ParquetStream, SyntheticStream
from lit_seqpack.data.streaming.buffer import OverlongCounter, stream_windows
from lit_seqpack.planning.plan import PlanConfig, build_plan


def _config_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "mode": "packing",
        "max_tokens": args.max_tokens,
        "algorithm": "best_fit_decreasing",
        "world_size": args.world,
        "accumulate_grad_batches": args.accumulate,
        "seed": 0,
    }


def _config(args: argparse.Namespace) -> PlanConfig:
    return PlanConfig(**_config_fields(args))


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

        def parquet_reader() -> int:
            return sum(1 for _ in ParquetStream(parquet).open())

        def parquet_loader() -> int:
            settings = {"max_tokens": args.max_tokens, "algorithm": "best_fit_decreasing", "num_workers": 0, "seed": 0}
            module = SeqPackDataModule(source=ParquetStream(parquet, vocab_size=512), window=1_000, **settings)
            return sum(int(batch["num_documents"]) for batch in module.train_dataloader())

        config = PlanConfig(mode="packing", max_tokens=args.max_tokens, algorithm="best_fit_decreasing", seed=0)
        stages = {
            "json.loads of each line (floor)": floor,
            "JsonlStream reader": reader,
            "reader + windows (checked, planned)": windows,
            "stream loader (collated microbatches)": loader,
        }
        parquet = f"{folder}/stream.parquet"
        if _write_parquet(path, parquet):  # the same rows, row groups of 2,000
            stages |= {"ParquetStream reader (same rows)": parquet_reader, "Parquet stream loader": parquet_loader}
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


def _write_parquet(jsonl: str, path: str) -> bool:
    """The rows of ``jsonl`` as a Parquet file (row groups of 2,000); ``False`` without pyarrow."""
    try:
        import pyarrow.json
        import pyarrow.parquet as pq
    except ImportError:
        return False
    # pyarrow parses the lines itself: millions of Python ints made and freed here slowed the stages after by 15%
    pq.write_table(pyarrow.json.read_json(jsonl), path, row_group_size=2_000)
    return True


def _write_shards(args: argparse.Namespace, folder: Path) -> list[int]:
    """``--rank-samples`` lognormal samples as 8 JSONL shards; their lengths."""
    lengths, handles = [], [open(folder / f"part-{i}.jsonl", "w") for i in range(8)]  # noqa: SIM115
    for number, sample in enumerate(_stream(args, args.rank_samples).open()):
        handles[number % 8].write(json.dumps({"input_ids": sample["input_ids"]}) + "\n")
        lengths.append(len(sample["input_ids"]))
    for handle in handles:
        handle.close()
    return lengths


def rank_child(rank: int, world: int, port: int, split: str, folder: str, args: argparse.Namespace) -> None:
    """One gloo rank: drain the training loader; rank 0 writes every rank's figures to ``folder/result.json``."""
    import torch
    import torch.distributed as dist

    from lit_seqpack.data.settings import BatchingSettings
    from lit_seqpack.data.sources import JsonlStream
    from lit_seqpack.data.streaming.pipeline import StreamPipeline
    from lit_seqpack.parallel import DataParallelLayout

    torch.set_num_threads(1)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    dist.init_process_group("gloo", rank=rank, world_size=world)
    settings = BatchingSettings(
        max_tokens=args.max_tokens, algorithm="best_fit_decreasing", window=args.rank_buffer, stream_split=split,
        content_check_samples=8 if split == "replicate" else 0,
    )  # fmt: skip
    pipeline = StreamPipeline(settings, JsonlStream(str(Path(folder, "shards")), vocab_size=512))
    pipeline.layout = DataParallelLayout(world_size=world, rank=rank, accumulate_grad_batches=args.accumulate)
    next(iter(pipeline.train_loader()))  # warm up (imports, cached planner kernels): the steady state is measured
    dist.barrier()
    mine = _drain_steps(pipeline.train_loader, args.accumulate, time.process_time)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(folder, "result.json").write_text(json.dumps(everyone))
    dist.destroy_process_group()


def _drain_steps(make_loader: Callable[[], Iterable[Any]], accumulate: int, clock: Callable[[], float]) -> dict:
    """One rank's pass: CPU seconds (``clock``), wall seconds, real tokens of each step, microbatches."""
    wall, cpu = time.perf_counter(), clock()
    steps: list[int] = []
    microbatches = 0
    for number, batch in enumerate(make_loader()):
        if number % accumulate == 0:
            steps.append(0)
        steps[-1] += int(batch["num_real_tokens"]) if not batch["is_empty"] else 0
        microbatches += 1
    return {"cpu": clock() - cpu, "wall": time.perf_counter() - wall, "steps": steps, "mb": microbatches}


def simulated_ranks(world: int, folder: str, args: argparse.Namespace) -> list[dict]:
    """``stream_split="rank"`` on ``world`` ranks simulated by threads of this process (the collective is a barrier;
    CPU is each thread's own), for world sizes the box cannot run as processes."""
    import threading

    from lit_seqpack.data.settings import BatchingSettings
    from lit_seqpack.data.sources import JsonlStream
    from lit_seqpack.data.streaming.dataset import StreamingDataset
    from lit_seqpack.data.streaming.loader import StreamingDataLoader
    from lit_seqpack.parallel import DataParallelLayout

    settings = BatchingSettings(max_tokens=args.max_tokens, algorithm="best_fit_decreasing", window=args.rank_buffer)
    barrier, slots, results = threading.Barrier(world), [None] * world, [None] * world

    def gather_of(rank: int) -> Callable[[Any], list[Any]]:
        def gather(value: Any) -> list[Any]:
            slots[rank] = value
            barrier.wait()
            everyone = list(slots)
            barrier.wait()
            return everyone

        return gather

    def run(rank: int) -> None:
        dataset = StreamingDataset(
            JsonlStream(str(Path(folder, "shards")), vocab_size=512).split(rank, world),
            config=settings.plan_config(DataParallelLayout(accumulate_grad_batches=args.accumulate)),
            rank=0, window_size=args.rank_buffer, collator=settings.collator(), data_parallel=(rank, world),
        )  # fmt: skip
        loader = lambda: StreamingDataLoader(dataset, gather=gather_of(rank))  # noqa: E731
        results[rank] = _drain_steps(loader, args.accumulate, time.thread_time)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results  # type: ignore[return-value]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_row(world: int | str, split: str, ranks: list[dict[str, Any]], offline: float, max_tokens: int) -> list[str]:
    steps = np.array([r["steps"] for r in ranks], dtype=np.float64)  # [ranks, steps]: the same steps on each rank
    tokens = steps.sum(axis=1)
    cpu_per_token = float(np.mean([r["cpu"] / t for r, t in zip(ranks, tokens, strict=True) if t])) * 1e6
    efficiency = tokens.sum() / (sum(r["mb"] for r in ranks) * max_tokens)
    full = (steps > 0).all(axis=0)  # steps where every rank trains (not filling after its share ended)
    ratio = steps.max(axis=0) / np.maximum(steps.mean(axis=0), 1)
    worst = f"{ratio[full].max():.3f} / {ratio[full].mean():.3f}" if full.any() else "-"
    return [
        str(world),
        split,
        f"{cpu_per_token:.2f}",
        f"{tokens.sum() / max(r['wall'] for r in ranks):,.0f}",
        f"{efficiency:.4f}",
        f"{efficiency / offline:.4f}",
        worst,
        str(int((~full).sum())),
    ]


def ranks_table(args: argparse.Namespace) -> str:
    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "shards").mkdir()
        lengths = np.array(_write_shards(args, Path(folder, "shards")), dtype=np.int64)
        for world in args.worlds:
            config = PlanConfig(**{**_config_fields(args), "world_size": world})
            plan = build_plan(lengths, config, epoch=0)
            offline = int(lengths.sum()) / (plan.microbatches_per_rank * world * args.max_tokens)
            for split in ("replicate", "rank"):
                mp.spawn(rank_child, args=(world, _free_port(), split, folder, args), nprocs=world, join=True)
                ranks = json.loads(Path(folder, "result.json").read_text())
                rows.append(_rank_row(world, split, ranks, offline, args.max_tokens))
        for world in args.simulated:
            config = PlanConfig(**{**_config_fields(args), "world_size": world})
            offline = int(lengths.sum()) / (
                build_plan(lengths, config, epoch=0).microbatches_per_rank * world * args.max_tokens
            )
            ranks = simulated_ranks(world, folder, args)
            rows.append(_rank_row(f"{world} (threads)", "rank", ranks, offline, args.max_tokens))
    headers = ["ranks", "stream_split", "CPU us/token/rank", "cluster tokens/s", "efficiency", "vs offline",
               "step max/mean: worst / mean", "filler steps"]  # fmt: skip
    title = (
        f"Real gloo ranks, {args.rank_samples:,} samples in 8 JSONL shards, buffer {args.rank_buffer:,}, "
        f"accumulation {args.accumulate}, max_tokens {args.max_tokens:,} (num_workers=0, after one warm-up batch; "
        "ranks marked threads share one process: their tokens/s is not a cluster's)"
    )
    return f"{title}\n\n{markdown_table(headers, rows)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200_000, help="samples of the packing table")
    parser.add_argument("--loader-samples", type=int, default=20_000, help="samples through the loaders")
    parser.add_argument("--read-samples", type=int, default=20_000, help="samples of the read-path table")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved passes of the read-path table")
    parser.add_argument("--buffers", type=int, nargs="+", default=[100, 1_000, 10_000])
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="20k samples for packing, 4k through the loaders")
    parser.add_argument("--worlds", type=int, nargs="*", default=[1, 2, 4], help="real gloo ranks of the rank table")
    parser.add_argument("--simulated", type=int, nargs="*", default=[8, 16], help="ranks simulated by threads")
    parser.add_argument("--rank-samples", type=int, default=6_000, help="samples of the rank table")
    parser.add_argument("--rank-buffer", type=int, default=1_000, help="stream window of the rank table")
    parser.add_argument(
        "--only", choices=["packing", "loader", "read-path", "ranks"], default=None, help="run one table"
    )
    args = parser.parse_args()
    if args.quick:
        args.samples, args.loader_samples, args.read_samples = 20_000, 4_000, 4_000
    print(machine_summary())
    tables = {"packing": packing_table, "loader": loader_table, "read-path": read_path_table, "ranks": ranks_table}
    for name, table in tables.items():
        if args.only in (None, name) and (name != "ranks" or args.worlds or args.simulated):
            print()
            print(table(args))


if __name__ == "__main__":
    main()
