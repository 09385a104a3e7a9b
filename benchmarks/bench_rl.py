"""Rank balance of a rollout: lit_seqpack.rl's sample-level Karmarkar-Karp vs round-robin and per-step KK on bins.

A rollout of ``N`` lognormal lengths (median ``--median``, sigma ``--sigma``, clipped to [16, ``--max-tokens``]) is
one optimizer step (``--steps`` to cut it in more) over ``W`` data-parallel ranks. Three ways to deal it:

- ``round-robin``: sample ``i`` to rank ``i % W`` (what a plain ``DistributedSampler`` shard does), packed per rank;
- ``KK on bins``: the step packed first (first fit decreasing, ``max_tokens``), then whole bins dealt over ranks by
  Karmarkar-Karp on their cost (the granularity of microbatch-level balancing);
- ``rl (samples)``: :func:`lit_seqpack.planning.rollout.plan_rollout`, Karmarkar-Karp over the samples, then packed.

Each row gives max/mean over ranks (worst step) of the real tokens and of the cost ``L + L^2 / max_tokens`` each
rank runs; ``cost bound`` is the best any dealing can do, the costliest sample over the mean rank cost (a sample is
indivisible); for ``rl`` the microbatches per rank (lock step) and the planning time per rollout.

The second table times :meth:`lit_seqpack.rl.RolloutPlanner.plan` (a fresh planner each time, on a
:class:`~lit_seqpack.rl.Rollout` of those lengths) against NeMo-RL's ``shard_by_batch_size(sequence_packing_args=...)``
(re-implemented in ``_reference_shard.py``: its planning half, without its data movement, with its default
``modified_first_fit_decreasing`` packer and round-robin bins), alternately in one process, ``--repeats`` times each;
medians, and the worst step's max/mean over ranks of each plan (tokens | cost).

The third table is one GRPO step's planning + loss time at ``--loss-samples`` samples (groups of 8, one rank): a fresh
``RolloutPlanner.plan`` plus, over every training microbatch (collated beforehand), a per-token loss and its
``step_loss`` forward and backward on leaf log-probs (no model); the baseline is PPO's clipped loss with a k3 KL and
token normalisation; each other row adds :func:`~lit_seqpack.rl.advantages.advantages` +
``spread_over_tokens`` and swaps in one new loss or normalisation. Each part is timed on its own, interleaved, and
the minimum of ``--repeats`` is kept (robust on a shared box).

    .venv/bin/python benchmarks/bench_rl.py
    .venv/bin/python benchmarks/bench_rl.py --samples 512 --ranks 8 --median 1024
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from _reference_shard import nemo_rl_shard

from lit_seqpack.planning.algorithms import get_packer
from lit_seqpack.planning.balance import karmarkar_karp
from lit_seqpack.planning.rollout import RolloutPlanConfig, plan_rollout
from lit_seqpack.rl import Rollout, RolloutPlanner
from lit_seqpack.rl.advantages import advantages, spread_over_tokens
from lit_seqpack.rl.loss import cispo_loss, clipped_policy_loss, reinforce_loss, sapo_loss, step_loss
from lit_seqpack.rl.objectives import kl_estimate


def _ratio(loads: np.ndarray) -> float:
    return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def _round_robin(lengths: np.ndarray, costs: np.ndarray, steps: list[np.ndarray], ranks: int) -> tuple[float, float]:
    tokens = max(_ratio(np.bincount(np.arange(s.size) % ranks, weights=lengths[s], minlength=ranks)) for s in steps)
    cost = max(_ratio(np.bincount(np.arange(s.size) % ranks, weights=costs[s], minlength=ranks)) for s in steps)
    return tokens, cost


def _bins_kk(
    lengths: np.ndarray, costs: np.ndarray, steps: list[np.ndarray], ranks: int, max_tokens: int
) -> tuple[float, float]:
    worst_tokens = worst_cost = 1.0
    for step in steps:
        bins = get_packer("first_fit_decreasing", max_tokens, min_bin_count=min(ranks, step.size)).pack(lengths[step])
        bin_tokens = np.array([lengths[step[b]].sum() for b in bins], dtype=np.float64)
        bin_costs = np.array([costs[step[b]].sum() for b in bins])
        parts = karmarkar_karp(bin_costs, ranks)
        worst_tokens = max(worst_tokens, _ratio(np.array([bin_tokens[p].sum() for p in parts])))
        worst_cost = max(worst_cost, _ratio(np.array([bin_costs[p].sum() for p in parts])))
    return worst_tokens, worst_cost


def _nemo_rl_balance(
    tokens: list[list[list[int]]], samples: list[list[list[int]]], costs: np.ndarray, steps: int
) -> tuple[float, float]:
    """Worst step's max/mean over shards of NeMo-RL's plan: tokens (bins' sums) and cost (its samples' costs)."""
    worst_tokens = worst_cost = 1.0
    for step in range(steps):
        loads = np.array([sum(shard[step]) for shard in tokens], dtype=np.float64)
        worst_tokens = max(worst_tokens, _ratio(loads))
    bins_per_step = [len(tokens[0][step]) for step in range(steps)]
    for step in range(steps):
        first = sum(bins_per_step[:step])
        loads = np.array([sum(costs[i].sum() for i in shard[first : first + bins_per_step[step]]) for shard in samples])
        worst_cost = max(worst_cost, _ratio(loads))
    return worst_tokens, worst_cost


def _time_against_nemo_rl(lengths: np.ndarray, costs: np.ndarray, ranks: int, args: argparse.Namespace) -> str:
    """One row of the second table: interleaved timings (medians) and each plan's worst step."""
    rollout = Rollout(input_ids=[torch.ones(int(n), dtype=torch.long) for n in lengths])
    as_tensor = torch.as_tensor(lengths)
    batch = lengths.size // args.steps
    kwargs = {"train_max_tokens": args.max_tokens, "samples_per_step": batch, "world_size": ranks, "rank": 0}
    RolloutPlanner(**kwargs).plan(rollout)  # loads the compiled kernels
    ours, theirs = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan = RolloutPlanner(**kwargs).plan(rollout)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        samples, _, tokens = nemo_rl_shard(as_tensor, ranks, args.max_tokens, batch_size=batch)
        theirs.append(time.perf_counter() - start)
    mine, nemo = float(np.median(ours)), float(np.median(theirs))
    rl = (plan.imbalance("tokens")[1], plan.imbalance("cost")[1])
    nemo_balance = _nemo_rl_balance(tokens, samples, costs, args.steps)
    return (
        f"| {lengths.size} | {ranks} | {mine * 1e3:.1f} ms | {nemo * 1e3:.1f} ms | {mine / nemo:.2f}x | "
        f"{rl[0]:.4f} \\| {rl[1]:.4f} | {nemo_balance[0]:.4f} \\| {nemo_balance[1]:.4f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per rollout")
    parser.add_argument("--median", type=float, default=512)
    parser.add_argument("--sigma", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=7, help="timings of each planner (interleaved; medians)")
    parser.add_argument("--loss-samples", type=int, default=4096, help="samples of the loss-time table (0: skip)")
    args = parser.parse_args()
    print(
        f"lognormal rollout lengths (median {args.median:g}, sigma {args.sigma:g}), {args.steps} step(s) per rollout, "
        f"microbatches of {args.max_tokens} tokens; max/mean over ranks, worst step (tokens | cost L + L^2/C)\n"
    )
    print("| samples | ranks | round-robin | KK on bins | rl (samples) | cost bound | rl microbatches/rank | rl plan |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    timed = []
    for n in args.samples:
        lengths, costs = _lengths(n, args)
        steps = np.array_split(np.arange(n), args.steps)
        for ranks in args.ranks:
            rr = _round_robin(lengths, costs, steps, ranks)
            kk = _bins_kk(lengths, costs, steps, ranks, args.max_tokens)
            config = RolloutPlanConfig(max_tokens=args.max_tokens, world_size=ranks, steps_per_rollout=args.steps)
            start = time.perf_counter()
            plan = plan_rollout(lengths, config)
            elapsed = time.perf_counter() - start
            rl = (plan.imbalance("tokens")[1], plan.imbalance("cost")[1])
            cells = [f"{t:.4f} \\| {c:.4f}" for t, c in (rr, kk, rl)]
            cells.append(f"{max(1.0, float(costs.max()) / (costs.sum() / ranks)):.4f}")  # one sample is indivisible
            print(
                f"| {n} | {ranks} | "
                + " | ".join(cells)
                + f" | {plan.accumulate_grad_batches} | {elapsed * 1e3:.0f} ms |"
            )
            timed.append(_time_against_nemo_rl(lengths, costs, ranks, args))
    print(
        f"\nPlanning time, RolloutPlanner.plan vs NeMo-RL's shard_by_batch_size with sequence packing "
        f"(re-implemented, planning only), interleaved, median of {args.repeats}; worst step max/mean (tokens | cost)\n"
    )
    print("| samples | ranks | lit_seqpack | NeMo-RL | ratio | lit_seqpack balance | NeMo-RL balance |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(timed))
    if args.loss_samples:
        print(_loss_overhead(args))


LOSS_VARIANTS = {  # name -> (per-token policy loss, normalize, loss_scale_factor)
    "PPO + k3, token (baseline)": (lambda lp, b: clipped_policy_loss(lp, b["old"], b["adv"]), "token", None),
    "+ advantages, PPO + k3, token": (lambda lp, b: clipped_policy_loss(lp, b["old"], b["adv"]), "token", None),
    "+ advantages, CISPO + k3, sequence_token_sum": (
        lambda lp, b: cispo_loss(lp, b["old"], b["adv"]),
        "sequence_token_sum",
        None,
    ),
    "+ advantages, SAPO + k3, constant": (lambda lp, b: sapo_loss(lp, b["old"], b["adv"]), "constant", 4096.0),
    "+ advantages, REINFORCE + k3+, token": (lambda lp, b: reinforce_loss(lp, b["adv"]), "token", None),
}


def _loss_overhead(args: argparse.Namespace) -> str:
    """The third table: planning + loss time of one GRPO step per variant, against the baseline."""
    n = args.loss_samples
    lengths, _ = _lengths(n, args)
    gen = torch.Generator().manual_seed(args.seed)
    groups = torch.arange(n) // 8
    rewards = torch.rand(n, generator=gen)
    masks = [torch.arange(int(k)) >= int(k) // 4 for k in lengths]
    rollout = Rollout(
        input_ids=[torch.ones(int(k), dtype=torch.long) for k in lengths], loss_mask=masks, group_ids=groups
    )
    fields = {name: [-torch.rand(int(k), generator=gen) for k in lengths] for name in ("old", "ref")}
    fields["adv"] = spread_over_tokens(advantages(rewards, groups), rollout)
    rollout = rollout.with_fields(token_fields=fields)
    kwargs = {"train_max_tokens": args.max_tokens, "steps_per_rollout": 1, "world_size": 1, "rank": 0}
    batches = list(RolloutPlanner(**kwargs).train_microbatches(rollout))  # collated once, outside the timing
    leaves = [(b["old"] + 0.1).requires_grad_() for b in batches]

    def loss_pass(name: str) -> float:
        fn, normalize, factor = LOSS_VARIANTS[name]
        kl = "k3+" if "k3+" in name else "k3"
        start = time.perf_counter()
        for batch, lp in zip(batches, leaves, strict=True):
            loss = fn(lp, batch) + 0.01 * kl_estimate(lp, batch["ref"], kl)
            step_loss(loss, batch, normalize=normalize, loss_scale_factor=factor, optimization="manual").backward()
        return time.perf_counter() - start

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    plan_times, adv_times = [], []
    times: dict[str, list[float]] = {name: [] for name in LOSS_VARIANTS}
    for _ in range(args.repeats):  # interleaved; minimum of the repeats (the box may be shared)
        plan_times.append(timed(lambda: RolloutPlanner(**kwargs).plan(rollout)))
        adv_times.append(
            timed(lambda: spread_over_tokens(advantages(rewards, groups, token_counts=rollout.loss_tokens), rollout))
        )
        for name in LOSS_VARIANTS:
            times[name].append(loss_pass(name))
    plan, adv = min(plan_times), min(adv_times)
    base_name = next(iter(LOSS_VARIANTS))
    base = plan + min(times[base_name])
    rows = [
        f"\nOne GRPO step's planning + loss time, {n} samples ({int(lengths.sum())} tokens, {len(batches)} "
        f"microbatches of {args.max_tokens} tokens, 1 rank), interleaved, minimum of {args.repeats}: plan "
        f"{plan * 1e3:.1f} ms, advantages + spread_over_tokens {adv * 1e3:.1f} ms\n",
        "| variant | planning + loss | vs baseline |",
        "|---|---:|---:|",
    ]
    for name, values in times.items():
        total = plan + min(values) + (adv if name != base_name else 0.0)
        rows.append(f"| {name} | {total * 1e3:.1f} ms | {100 * (total / base - 1):+.1f}% |")
    return "\n".join(rows)


def _lengths(n: int, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """Lognormal lengths clipped to [16, max_tokens], and their balance cost ``L + L^2 / max_tokens``."""
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(args.median), args.sigma, n)), 16, args.max_tokens)
    lengths = lengths.astype(np.int64)
    return lengths, lengths + lengths.astype(np.float64) ** 2 / args.max_tokens


if __name__ == "__main__":
    main()
