"""Benchmark the planner: the packers against the lower bound and pure-Python packers, ``build_plan`` against a sort.

Two Markdown tables:

1. **Packers.** For each length distribution (lognormal median 512 sigma 1, power law p(L) ~ L^-1.5, uniform; all
   on [16, 4096]), size and algorithm: bins, theoretical minimum, efficiency, median seconds of ``--repeats``
   calls of ``get_packer(...).pack`` (after a warm-up that compiles or loads the numba cache), and the time and
   bins of the pure-Python packer of ``_reference_packers.py`` (run once, only up to ``--reference-max-size``;
   "n/a" above it, nothing is extrapolated).
2. **build_plan against one sort.** For each of ``--plan-sizes`` (lognormal lengths) and each mode (packing with
   the default ``first_fit_decreasing``, dynamic, padded; ``--world`` ranks x ``--accumulate`` accumulation,
   ``max_tokens`` 4096, padded ``batch_size`` 8): the median seconds of ``build_plan`` and its ratio to one stable
   numpy argsort of the same lengths (``np.argsort(lengths, kind="stable")``, the floor any sort-based planner
   pays). Sort and plans are interleaved in every repeat and the ratio is the median of the per-repeat ratios, so
   load drift on a shared machine hits both alike. Then the growth of each from the smallest to the largest size.

Run it with one thread (``OMP_NUM_THREADS=1``) on a quiet machine::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_planner.py                 # both tables
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_planner.py --only plan     # 1M and 10M, 5 repeats
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_planner.py --quick         # 10k and 100k, 1M plan only
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _reference_packers import REFERENCE_PACKERS  # benchmarks/ is sys.path[0] when run as a script

from lit_seqpack.planning import _kernels
from lit_seqpack.planning.algorithms import PACKING_ALGORITHMS, get_packer
from lit_seqpack.planning.plan import PlanConfig, build_plan
from lit_seqpack.planning.stats import packing_stats

LOW, HIGH = 16, 4096


def lognormal(n: int, rng: np.random.Generator) -> np.ndarray:
    return np.clip(np.round(rng.lognormal(np.log(512), 1.0, n)), LOW, HIGH).astype(np.int64)


def power_law(n: int, rng: np.random.Generator, exponent: float = 1.5) -> np.ndarray:
    """Inverse-CDF sampling of p(L) ~ L^-exponent on [LOW, HIGH]."""
    a = 1.0 - exponent
    u = rng.random(n)
    values = (LOW**a + u * (HIGH**a - LOW**a)) ** (1.0 / a)
    return np.clip(np.round(values), LOW, HIGH).astype(np.int64)


def uniform(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(LOW, HIGH + 1, n).astype(np.int64)


DISTRIBUTIONS: dict[str, Callable[[int, np.random.Generator], np.ndarray]] = {
    "lognormal": lognormal,
    "power_law": power_law,
    "uniform": uniform,
}


def seconds(repeats: int, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls of ``fn(*args)``, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def row(dist: str, lengths: np.ndarray, algorithm: str, args: argparse.Namespace) -> str:
    """One Markdown table row: the packer's bins and median time, and the reference's when small enough."""
    packer = get_packer(algorithm, args.capacity, seed=args.seed)
    took, bins = seconds(args.repeats, packer.pack, lengths)
    stats = packing_stats(lengths, bins, args.capacity)
    ref_s = speedup = ref_bins = "n/a"
    if lengths.shape[0] <= args.reference_max_size:
        reference = REFERENCE_PACKERS[algorithm]
        ref_took, ref = seconds(1, reference, lengths.tolist(), args.capacity, args.seed)
        ref_s, speedup, ref_bins = f"{ref_took:.3f}", f"{ref_took / took:,.1f}x", f"{len(ref):,}"
    return (
        f"| {dist} | {lengths.shape[0]:,} | {algorithm} | {stats.num_bins:,} | {stats.theoretical_min_bins:,} | "
        f"{stats.packing_efficiency:.5f} | {took:.4f} | {ref_s} | {speedup} | {ref_bins} |"
    )


PLAN_MODES: dict[str, dict[str, Any]] = {
    "packing": {"mode": "packing", "max_tokens": HIGH},
    "dynamic": {"mode": "dynamic", "max_tokens": HIGH},
    "padded": {"mode": "padded", "batch_size": 8},
}


def plan_against_sort(sizes: list[int], args: argparse.Namespace) -> None:
    """Table 2: median ``build_plan`` seconds per mode and size, and the median per-repeat ratio to one sort."""
    configs = {
        name: PlanConfig(world_size=args.world, accumulate_grad_batches=args.accumulate, seed=args.seed, **spec)
        for name, spec in PLAN_MODES.items()
    }
    print(f"\n## build_plan against one stable argsort of the lengths ({args.world} ranks x {args.accumulate} "
          f"accumulation, lognormal, median of {args.plan_repeats} interleaved repeats)\n")  # fmt: skip
    print("| n | mode | build_plan s | argsort s | x argsort |")
    print("|---:|---|---:|---:|---:|")
    medians: dict[tuple[str, int], float] = {}
    for n in sizes:
        lengths = lognormal(n, np.random.default_rng(args.seed))
        for config in configs.values():
            build_plan(lengths, config, epoch=0)  # warm-up: numba cache, allocator
        times: dict[str, list[float]] = {name: [] for name in ("argsort", *configs)}
        ratios: dict[str, list[float]] = {name: [] for name in configs}
        for repeat in range(args.plan_repeats):
            sort_s, _ = seconds(1, np.argsort, lengths, -1, "stable")
            times["argsort"].append(sort_s)
            for name, config in configs.items():
                plan_s, _ = seconds(1, lambda c=config, e=repeat, x=lengths: build_plan(x, c, epoch=e))
                times[name].append(plan_s)
                ratios[name].append(plan_s / sort_s)
        medians[("argsort", n)] = statistics.median(times["argsort"])
        for name in configs:
            medians[(name, n)] = statistics.median(times[name])
            print(f"| {n:,} | {name} | {medians[(name, n)]:.3f} | {medians[('argsort', n)]:.3f} | "
                  f"{statistics.median(ratios[name]):.2f}x |", flush=True)  # fmt: skip
    if len(sizes) > 1:
        small, large = sizes[0], sizes[-1]
        growth = ", ".join(
            f"{name} {medians[(name, large)] / medians[(name, small)]:.1f}x" for name in ("argsort", *configs)
        )
        print(f"\ngrowth from {small:,} to {large:,} samples ({large / small:.0f}x): {growth}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated sequence counts")
    parser.add_argument("--quick", action="store_true", help="sizes 10k,100k, reference at 10k, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median reported)")
    parser.add_argument("--reference-max-size", type=int, default=100_000, help="largest n for the reference")
    parser.add_argument("--distributions", default=",".join(DISTRIBUTIONS))
    parser.add_argument("--algorithms", default=",".join(PACKING_ALGORITHMS))
    parser.add_argument("--capacity", type=int, default=HIGH)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=["packers", "plan"], default=None, help="one table only")
    parser.add_argument("--plan-sizes", default="1000000,10000000", help="build_plan table: comma-separated sizes")
    parser.add_argument("--plan-repeats", type=int, default=5, help="build_plan table: interleaved repeats")
    parser.add_argument("--world", type=int, default=8, help="build_plan table: ranks")
    parser.add_argument("--accumulate", type=int, default=4, help="build_plan table: accumulation")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.reference_max_size, args.repeats = "10000,100000", 10_000, 1
        args.plan_sizes, args.plan_repeats = "1000000", 3
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    algorithms = args.algorithms.split(",")
    print(f"# python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, numba compiled: {_kernels.numba_enabled()}")  # fmt: skip
    if args.only != "packers":
        plan_against_sort([int(s) for s in args.plan_sizes.split(",")], args)
    if args.only == "plan":
        return
    print()
    start = time.perf_counter()
    warm = lognormal(2000, np.random.default_rng(0))
    for algorithm in algorithms:
        get_packer(algorithm, args.capacity).pack(warm)
    print(f"# warm-up (compile or load the numba cache): {time.perf_counter() - start:.2f} s")
    print(f"# capacity {args.capacity}, median of {args.repeats} calls; reference once, n <= {args.reference_max_size}")
    print()
    print("| lengths | n | algorithm | bins | min bins | efficiency | seconds | reference s | speedup | ref. bins |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for dist in args.distributions.split(","):
        for n in sizes:
            lengths = DISTRIBUTIONS[dist](n, np.random.default_rng(args.seed))
            for algorithm in algorithms:
                print(row(dist, lengths, algorithm, args), flush=True)


if __name__ == "__main__":
    main()
