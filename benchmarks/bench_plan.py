"""Benchmark the global plan: planning time at scale, and quality against a NeMo-RL-style baseline.

Four Markdown tables:

1. Time to plan one epoch of ``--size`` sequences (default 1M, lognormal) at ``--world`` ranks x
   ``--accumulate`` accumulation, per mode (median of ``--repeats`` calls after a warm-up).
2. Efficiency against ``window`` (why the default is ``None``, the whole epoch).
3. The plan against a NeMo-RL-style baseline on lognormal and power-law data: the baseline packs each
   global batch of ``--chunk`` sequences on its own (first fit decreasing, bin count a multiple of the
   world size) and deals bins to ranks round-robin, so ranks see different token counts and the
   number of microbatches per step changes from step to step. It uses this package's packer, so its
   seconds are this package's packing speed plus the per-chunk loop, not NeMo-RL's pure-Python packers.

A window must fill whole optimizer steps (``world x accumulate`` microbatches, the lock-step rule), so a
window holding fewer tokens than a few steps' budget packs poorly: the ``accumulate 1`` row shows it.

4. Rank balance on the attention-heavy cost ``L + L^2/max_tokens`` per document (what a long-context step
   costs with varlen attention), for each ``cost_quadratic`` setting: per step max/mean over ranks of that
   cost (mean and worst over steps), and of the real tokens.

Columns: microbatches over all ranks (empty fillers included), efficiency = real tokens /
(microbatches x max_tokens), token imbalance = per optimizer step max/mean over ranks of the real tokens
each rank runs (mean and worst over steps), seconds.

    .venv/bin/python benchmarks/bench_plan.py                 # 1M timing, 200k comparisons
    .venv/bin/python benchmarks/bench_plan.py --max-tokens 8192
    .venv/bin/python benchmarks/bench_plan.py --quick         # 100k timing, 50k comparisons
    .venv/bin/python benchmarks/bench_plan.py --only balance  # the cost_quadratic table alone
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from lit_seqpack.planning.algorithms import get_packer
from lit_seqpack.planning.plan import PlanConfig, build_plan

LOW, HIGH = 16, 4096


def lognormal(n: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths, median 512, sigma 1, clipped to [16, 4096]."""
    return np.clip(np.round(rng.lognormal(np.log(512), 1.0, n)), LOW, HIGH).astype(np.int64)


def power_law(n: int, rng: np.random.Generator, exponent: float = 1.5) -> np.ndarray:
    """p(L) ~ L^-exponent on [16, 4096] by inverse-CDF sampling."""
    a = 1.0 - exponent
    values = (LOW**a + rng.random(n) * (HIGH**a - LOW**a)) ** (1.0 / a)
    return np.clip(np.round(values), LOW, HIGH).astype(np.int64)


BALANCE_SETTINGS: tuple[float | str, ...] = (0.0, "auto")  # before (b = 0) and after (b = 1/max_tokens)
DISTRIBUTIONS: dict[str, Callable[[int, np.random.Generator], np.ndarray]] = {
    "lognormal": lognormal,
    "power_law": power_law,
}


def imbalance(rank_tokens: list[np.ndarray]) -> tuple[float, float]:
    """Mean and max over steps of max/mean of the per-rank token counts of each step."""
    ratios = [float(t.max() / t.mean()) for t in rank_tokens if t.mean() > 0]
    return float(np.mean(ratios)), float(np.max(ratios))


def nemo_rl_style(lengths: np.ndarray, max_tokens: int, world: int, chunk: int) -> dict[str, float]:
    """Per-chunk packing with round-robin bins: what NeMo-RL does for each global batch."""
    start = time.perf_counter()
    packer = get_packer("first_fit_decreasing", max_tokens, bin_count_multiple=world)
    order = np.random.default_rng(0).permutation(lengths.size)
    microbatches, rank_tokens = 0, []
    for begin in range(0, lengths.size, chunk):
        chunk_lengths = lengths[order[begin : begin + chunk]]
        bins = packer.pack(chunk_lengths)
        microbatches += len(bins)
        tokens = np.zeros(world, dtype=np.int64)
        for b, members in enumerate(bins):
            tokens[b % world] += int(chunk_lengths[members].sum())
        rank_tokens.append(tokens)
    seconds = time.perf_counter() - start
    mean, worst = imbalance(rank_tokens)
    efficiency = lengths.sum() / (microbatches * max_tokens)
    return {"microbatches": microbatches, "efficiency": efficiency, "mean": mean, "max": worst, "seconds": seconds}


def ours(lengths: np.ndarray, config: PlanConfig) -> dict[str, float]:
    start = time.perf_counter()
    stats = build_plan(lengths, config, epoch=0).stats
    seconds = time.perf_counter() - start
    return {
        "microbatches": stats.num_microbatches,
        "efficiency": stats.utilization,
        "mean": stats.imbalance_mean,
        "max": stats.imbalance_max,
        "seconds": seconds,
    }


def fmt(name: str, dist: str, r: dict[str, float]) -> str:
    return (
        f"| {dist} | {name} | {r['microbatches']:,} | {r['efficiency']:.4f} | {r['mean']:.4f} | "
        f"{r['max']:.3f} | {r['seconds']:.2f} |"
    )


def timing_table(args: argparse.Namespace) -> None:
    lengths = lognormal(args.size, np.random.default_rng(args.seed))
    print(f"\n### Planning one epoch of {args.size:,} lognormal sequences, {args.world} ranks x {args.accumulate}\n")
    print("| mode | microbatches | efficiency | imbalance mean | median s |")
    print("|---|---|---|---|---|")
    for mode in ("packing", "dynamic", "padded"):
        budget = {"batch_size": 8} if mode == "padded" else {"max_tokens": args.max_tokens}
        config = PlanConfig(mode=mode, world_size=args.world, accumulate_grad_batches=args.accumulate, **budget)
        times, stats = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            stats = build_plan(lengths, config, epoch=len(times)).stats
            times.append(time.perf_counter() - start)
        print(
            f"| {mode} | {stats.num_microbatches:,} | {stats.utilization:.4f} | {stats.imbalance_mean:.4f} | "
            f"{statistics.median(times):.2f} |"
        )


def window_table(args: argparse.Namespace) -> None:
    print(
        f"\n### Packing efficiency against window ({args.compare_size:,} sequences, {args.world} x {args.accumulate})\n"
    )
    print("| distribution | window | microbatches | efficiency | imbalance mean | imbalance max | s |")
    print("|---|---|---|---|---|---|---|")
    for dist, sample in DISTRIBUTIONS.items():
        lengths = sample(args.compare_size, np.random.default_rng(args.seed))
        for window in (256, 1024, 4096, 16384, 65536, None):
            config = PlanConfig(
                mode="packing",
                max_tokens=args.max_tokens,
                window=window,
                world_size=args.world,
                accumulate_grad_batches=args.accumulate,
            )
            print(fmt(str(window), dist, ours(lengths, config)))


def comparison_table(args: argparse.Namespace) -> None:
    print(
        f"\n### Plan vs NeMo-RL-style baseline ({args.compare_size:,} sequences, max_tokens {args.max_tokens}, "
        f"{args.world} ranks x {args.accumulate}, baseline chunk {args.chunk})\n"
    )
    print("| distribution | method | microbatches | efficiency | imbalance mean | imbalance max | s |")
    print("|---|---|---|---|---|---|---|")
    for dist, sample in DISTRIBUTIONS.items():
        lengths = sample(args.compare_size, np.random.default_rng(args.seed))
        print(
            fmt(
                f"NeMo-RL-style (chunk {args.chunk}, round-robin)",
                dist,
                nemo_rl_style(lengths, args.max_tokens, args.world, args.chunk),
            )
        )
        for label, mode, window, accumulate in (
            (f"plan packing, window {args.chunk}", "packing", args.chunk, args.accumulate),
            (f"plan packing, window {args.chunk}, accumulate 1", "packing", args.chunk, 1),
            ("plan packing, window None", "packing", None, args.accumulate),
            ("plan dynamic, window None", "dynamic", None, args.accumulate),
        ):
            config = PlanConfig(
                mode=mode,
                max_tokens=args.max_tokens,
                window=window,
                world_size=args.world,
                accumulate_grad_batches=accumulate,
            )
            print(fmt(label, dist, ours(lengths, config)))


def attention_imbalance(lengths: np.ndarray, config: PlanConfig, context: int) -> tuple[float, float, float]:
    """Mean and worst over steps of max/mean of each rank's ``sum(L + L^2/context)``, and mean token max/mean."""
    plan = build_plan(lengths, config, epoch=0)
    cost = lengths.astype(np.float64) + lengths.astype(np.float64) ** 2 / context
    work = np.zeros((plan.num_steps, config.world_size))
    tokens = np.zeros_like(work)
    for position in range(plan.microbatches_per_rank):
        for rank in range(config.world_size):
            indices, step, _ = plan.microbatch(rank, position)
            work[step, rank] += cost[indices].sum()
            tokens[step, rank] += lengths[indices].sum()
    ratios = work.max(axis=1) / work.mean(axis=1)
    return float(ratios.mean()), float(ratios.max()), float((tokens.max(axis=1) / tokens.mean(axis=1)).mean())


def balance_table(args: argparse.Namespace) -> None:
    print(
        f"\n### Rank balance on the attention-heavy cost L + L^2/max_tokens ({args.compare_size:,} lognormal "
        f"sequences, {args.world} ranks)\n"
    )
    print("| mode | max_tokens | accumulate | cost_quadratic | cost max/mean | worst step | tokens max/mean |")
    print("|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(args.seed)
    for max_tokens in (4096, 8192, 32768):
        median = max_tokens // 8
        lengths = np.clip(np.round(rng.lognormal(np.log(median), 1.0, args.compare_size)), LOW, max_tokens)
        lengths = lengths.astype(np.int64)
        for mode in ("packing", "dynamic"):
            for accumulate in (1, args.accumulate):
                for setting in BALANCE_SETTINGS:
                    config = PlanConfig(
                        mode=mode,
                        max_tokens=max_tokens,
                        world_size=args.world,
                        accumulate_grad_batches=accumulate,
                        cost_quadratic=setting,
                    )
                    mean, worst, tokens = attention_imbalance(lengths, config, max_tokens)
                    cells = [mode, max_tokens, accumulate, setting, f"{mean:.4f}", f"{worst:.3f}", f"{tokens:.4f}"]
                    print("| " + " | ".join(map(str, cells)) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1_000_000, help="sequences in the timing table")
    parser.add_argument("--compare-size", type=int, default=200_000, help="sequences in the comparison tables")
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=256, help="baseline global batch (sequences)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="100k timing, 50k comparisons")
    parser.add_argument("--only", choices=["timing", "window", "comparison", "balance"], default=None)
    args = parser.parse_args()
    if args.quick:
        args.size, args.compare_size = 100_000, 50_000
    print(f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, {platform.machine()}")
    build_plan(lognormal(10_000, np.random.default_rng(1)), PlanConfig(max_tokens=4096), epoch=0)  # numba warm-up
    tables = {"timing": timing_table, "window": window_table, "comparison": comparison_table}
    tables["balance"] = balance_table
    for name, table in tables.items():
        if args.only in (None, name):
            table(args)


if __name__ == "__main__":
    main()
