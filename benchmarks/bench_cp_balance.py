"""Causal attention work per context-parallel rank: lit_seqpack's zigzag split vs the naive contiguous split.

Lognormal document lengths (median ``--median``, sigma ``--sigma``, clipped to [16, ``--max-tokens``]) are padded
to ``2 x cp`` (as ``SeqPackDataModule(context_parallel_size=cp)`` plans them), packed into rows of
``--max-tokens`` by the planner, and every row's causal work (query-key pairs) is split over the CP ranks. Each
Markdown row gives, over the microbatches, the mean and the worst ``max / mean`` of the per-rank work (1.000 is
perfect balance; the slowest rank sets the step time). ``computed`` counts every position the kernel computes
(padding included), ``real`` only real tokens.

    .venv/bin/python benchmarks/bench_cp_balance.py
    .venv/bin/python benchmarks/bench_cp_balance.py --samples 20000 --max-tokens 65536 --median 8192
"""

from __future__ import annotations

import argparse

import numpy as np

from lit_seqpack.planning.balance import causal_work_per_cp_rank, cp_work_imbalance
from lit_seqpack.planning.plan import PlanConfig, build_plan


def _rows(lengths: np.ndarray, cp: int, max_tokens: int) -> list[list[int]]:
    planned = -(-lengths // (2 * cp)) * (2 * cp)
    plan = build_plan(planned, PlanConfig(mode="packing", max_tokens=max_tokens, shuffle=False), epoch=0)
    return [[int(lengths[i]) for i in mb] for mb in plan.rank_microbatches(0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--median", type=float, default=2048)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    lengths = np.round(rng.lognormal(np.log(args.median), args.sigma, args.samples))
    lengths = np.clip(lengths, 16, args.max_tokens - 2 * max(args.cp)).astype(np.int64)
    print(
        f"{args.samples} lognormal lengths (median {args.median:g}, sigma {args.sigma:g}), rows of "
        f"{args.max_tokens} tokens; per-rank causal work max/mean over microbatches (mean | worst)\n"
    )
    print("| cp | microbatches | zigzag computed | zigzag real | contiguous computed | contiguous real |")
    print("|---:|---:|---:|---:|---:|---:|")
    for cp in args.cp:
        rows = _rows(lengths, cp, args.max_tokens)
        cells = []
        for split in ("zigzag", "contiguous"):
            for count in ("computed", "real"):
                ratio = cp_work_imbalance(causal_work_per_cp_rank(rows, cp, split=split, count=count))
                cells.append(f"{ratio.mean():.3f} \\| {ratio.max():.3f}")
        print(f"| {cp} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
