"""Training throughput of packing against maskless dynamic and padded baselines, side by side in one run.

For each length profile of the embedded synthetic task (``lognormal``, ``power_law``), every mode trains its own
copy of the same model (same initial weights, same seed) for one epoch over the same samples, so every mode
sees exactly the same real tokens:

* ``padded``: ``batch_size`` samples padded to the longest, the baseline; ``batch_size`` is the largest whose
  mean padded microbatch (``batch_size x longest``) fits ``max_tokens`` (the same memory budget on average);
* ``dynamic``: padded ``[rows, L]`` blocks with ``rows x L <= max_tokens``;
* ``packing <algorithm>``: rows of at most ``max_tokens`` tokens, one mode per packing algorithm.

The baselines are maskless: padded and dynamic microbatches are right-padded (every row its real tokens, then
padding), so ``ReferenceLM`` and ``HFCausalLM`` run causal attention with no mask (``is_causal``, exact for every
real token), as packed rows run varlen attention with none. A dense ``[B, 1, L, L]`` padding mask would cost the
baselines 1.17-1.20x on CPU and make packing look better than it is. The run checks every padded microbatch and
prints how many needed a mask (0 with the library's collators).

The path is the library's: each mode's batches come from a ``SeqPackDataModule`` training loader (planner,
batch sampler, collator; the DataModule gets a never-fitted ``Trainer`` only to read the accumulation from) and
each microbatch is ``module.training_step(batch, i)`` of the ``PackedSequenceMixin`` (``ReferenceLM``, or
``HFCausalLM`` with ``--model hf``), divided by the accumulation and back-propagated as Lightning does, then
the module's own AdamW (linear warmup, then a constant learning rate). The loop is written by hand instead of
``Trainer.fit`` so that no Lightning overhead or logging lands in the timings. The modes take turns in rounds of
real tokens (each round every mode trains whole optimizer steps until it passed the round's mark; the order
rotates), so load drift on a shared machine hits all of them alike.

Optimizer steps are matched in real tokens: a padded microbatch holds about half the real tokens of a packed
row, so with one microbatch per step the baseline would take twice as many optimizer steps for the same tokens
and its loss would not be comparable. Modes whose microbatches hold fewer real tokens than packing's
accumulate ``round(packing / theirs)`` microbatches per step (``--no-match-steps``: never); throughput is
measured per microbatch either way.

Reported per mode: accumulation, optimizer steps and real tokens per step; real tokens per second over the
timed microbatches (forward + backward, + AdamW on a step's last microbatch; the first microbatch and the
loader are excluded) by the wall clock and by this process's CPU time (on a shared machine the CPU time is what
the work cost; the wall time also holds the waits for a core), each with its ratios to the padded and to the
dynamic baseline; the
padding ratio; mean microbatch time; the largest microbatch (computed tokens, which activation memory scales
with, and attention-score elements ``sum of L^2`` per head and layer, what a kernel that materialises scores
holds: an analytic memory proxy, not a measurement); and the held-out loss (the same packed evaluation samples
for every mode, token mean over response tokens) at checkpoints of real tokens, the last after the epoch.

    .venv/bin/python benchmarks/bench_train.py --quick          # < 3 minutes on 2 CPU cores
    .venv/bin/python benchmarks/bench_train.py                  # the full run (~10 minutes)
    .venv/bin/python benchmarks/bench_train.py --model hf       # the same through a transformers Llama
    .venv/bin/python benchmarks/bench_train.py --quick --profile  # + torch.profiler top ops, padded and packed

The last four lines give packing (``first_fit_decreasing``, the DataModule's default, on ``power_law`` when it
ran) against dynamic and against padded, by CPU time and by the wall clock; the last one reads ``packed/padded
real-token throughput: <ratio>x`` (wall clock).
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
from _common import (  # benchmarks/ is sys.path[0] when run as a script
    PROFILES,
    build_module,
    fair_batch_size,
    human,
    load_average,
    machine_summary,
    markdown_table,
    matched_accumulation,
    num_parameters,
    profile_dataset,
    real_tokens_per_microbatch,
)
from _train_loop import ModeRun, datamodule_loader, held_out_batches, held_out_loss, profile_steps

from lit_seqpack.data.sources.synthetic import SYNTHETIC_TASKS
from lit_seqpack.planning import PACKING_ALGORITHMS

HEADLINE = "packing first_fit_decreasing"
SIZES = {  # model preset, median / longest sample, max_tokens, real tokens per mode, loss checkpoints, eval samples,
    # warmup steps (about 1/8 of the ~12 / ~80 optimizer steps of quick / full: without it some modes spike early)
    "smoke": dict(preset="tiny", median=16, max_len=128, max_tokens=256, tokens=2_000, checkpoints=2, eval=8,
                  warmup=1),
    "quick": dict(preset="demo", median=128, max_len=2048, max_tokens=2048, tokens=24_000, checkpoints=2, eval=32,
                  warmup=2),
    "full": dict(preset="demo", median=128, max_len=2048, max_tokens=2048, tokens=160_000, checkpoints=4, eval=128,
                 warmup=10),
}  # fmt: skip


def mode_specs(args: argparse.Namespace, batch_size: int) -> dict[str, dict]:
    """DataModule keyword arguments of every mode (``seed`` included).

    ``padded, other order`` is the baseline again with another shuffle seed: its distance to ``padded`` is what
    the order of the samples alone does to the figures (the noise floor of every comparison).
    """
    padded = {"mode": "padded", "batch_size": batch_size, "max_tokens": None, "seed": args.seed}
    specs = {
        "padded": padded,
        "padded, other order": padded | {"seed": args.seed + 1},
        "dynamic": {"mode": "dynamic", "max_tokens": args.max_tokens, "seed": args.seed},
    }
    if args.masked:  # the baselines as they ran before right padding went maskless: the mask's cost, in this run
        specs |= {f"{name} + mask": specs[name] | {"masked": True} for name in ("padded", "dynamic")}
    for algorithm in PACKING_ALGORITHMS:
        specs[f"packing {algorithm}"] = {"mode": "packing", "max_tokens": args.max_tokens, "algorithm": algorithm,
                                         "seed": args.seed}  # fmt: skip
    return {k: v for k, v in specs.items() if not args.modes or v.get("algorithm", v["mode"]) in args.modes}


def force_dense_mask(module: torch.nn.Module) -> None:
    """Make ``module`` attend through the dense padding mask even on right-padded batches (``--masked`` rows).

    The right-padding check is replaced, for this module's training steps only, by one that always answers no,
    so ``ReferenceDecoder`` builds its ``[B, 1, L, L]`` mask and ``hf_model_inputs`` keeps HF's padding mask.
    """
    from lit_seqpack.model import _hf_packed, reference

    step = module.training_step

    def training_step(batch, index):
        saved = reference.is_right_padded, _hf_packed.is_right_padded
        reference.is_right_padded = _hf_packed.is_right_padded = lambda mask: False
        try:
            return step(batch, index)
        finally:
            reference.is_right_padded, _hf_packed.is_right_padded = saved

    module.training_step = training_step


def training_set(profile: str, args: argparse.Namespace, *, tokens: int | None, seed: int, samples: int = 0):
    """The first samples of the profile's stream that hold at least ``tokens`` tokens (or ``samples`` samples)."""
    sizes = {"vocab_size": args.vocab_size, "median_length": args.median, "max_length": args.max_len, "seed": seed,
             "tasks": args.tasks}  # fmt: skip
    if tokens is not None:
        stream = profile_dataset(profile, num_samples=tokens // 6 + 1, **sizes)  # samples have >= 6 tokens
        samples = int(np.searchsorted(np.cumsum(stream.lengths), tokens)) + 1
    return profile_dataset(profile, num_samples=samples, **sizes)


def run_profile(profile: str, args: argparse.Namespace) -> tuple[dict[str, ModeRun], dict[str, list[float]]]:
    """Train every mode for one epoch over the same samples, interleaved in rounds; print the tables."""
    dataset = training_set(profile, args, tokens=args.tokens, seed=args.seed)
    lengths, total = dataset.lengths, int(dataset.lengths.sum())
    batch_size, mean_padded = fair_batch_size(lengths, args.max_tokens, seed=args.seed)
    batch_size = args.batch_size or batch_size
    eval_batches = held_out_batches(training_set(profile, args, tokens=None, seed=args.seed + 1, samples=args.eval),
                                    args.max_tokens)  # fmt: skip
    specs = mode_specs(args, batch_size)
    per_microbatch = {
        name: real_tokens_per_microbatch(lengths, spec, seed=spec["seed"]) for name, spec in specs.items()
    }
    reference = HEADLINE if HEADLINE in specs else max(per_microbatch, key=per_microbatch.get)
    accumulation = matched_accumulation(per_microbatch, reference) if args.match_steps else dict.fromkeys(specs, 1)
    runs = {}
    for name, spec in specs.items():
        torch.manual_seed(args.seed)  # identical initial weights in every mode
        module = build_module(args.model, preset=args.preset, vocab_size=args.vocab_size, max_seq_len=args.max_tokens,
                              lr=args.lr, warmup_steps=args.warmup)  # fmt: skip
        if spec.get("masked"):
            force_dense_mask(module)
        loader = datamodule_loader(
            dataset, {k: v for k, v in spec.items() if k != "masked"}, accumulate=accumulation[name]
        )
        runs[name] = ModeRun(name, module, loader, accumulate=accumulation[name])
    rounds = args.rounds or max(2, total // args.max_tokens)
    print(f"\n## {profile}: {len(dataset):,} samples, {total:,} tokens (length mean {lengths.mean():.0f}, median "
          f"{np.median(lengths):.0f}, p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}); max_tokens "
          f"{args.max_tokens}; padded batch_size {batch_size} (mean {mean_padded:.0f} tokens per microbatch); "
          f"one epoch per mode in {rounds} interleaved rounds; load average {load_average()}")  # fmt: skip
    marks = {max(1, round(rounds * (i + 1) / args.checkpoints)) for i in range(min(args.checkpoints, rounds))}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(1, rounds + 1):
        names = list(runs)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # rotate the order: no mode always runs first
            runs[name].train_until(total * round_index // rounds)
        if round_index in marks:
            for name, run in runs.items():
                losses[name].append(held_out_loss(run.module, eval_batches))
    print(f"load average after: {load_average()}\n")
    print_tables(runs, losses, [total * r // rounds for r in sorted(marks)])
    return runs, losses


def print_tables(runs: dict[str, ModeRun], losses: dict[str, list[float]], marks: list[int]) -> None:
    """The throughput table and the loss table of one profile."""
    padded, masked = (
        sum(getattr(run, key) for run in runs.values()) for key in ("padded_microbatches", "masked_microbatches")
    )
    print(f"Baselines without a mask: padded and dynamic microbatches are right-padded, so the model attends with "
          f"is_causal and no mask (exact for the real tokens); microbatches that needed a mask: {masked} of "
          f"{padded}{' (the + mask rows force one)' if any('+ mask' in name for name in runs) else ''}.\n")  # fmt: skip
    bases = {name: runs.get(name) for name in ("padded", "dynamic")}
    headers = ["mode", "accum", "opt steps", "real tok/step", "real tok/s", "x padded", "x dynamic", "real tok/CPU-s",
               "x padded (CPU)", "x dynamic (CPU)", "padding", "mb ms", "peak mb tokens", "peak attn L^2"]  # fmt: skip
    rows = []
    for name, run in runs.items():
        rates = []
        for clock in ("wall", "cpu"):
            rates.append(f"{run.rate(clock):,.0f}")
            for base in bases.values():
                ratio = run.rate(clock) / base.rate(clock) if base and base.rate(clock) else float("nan")
                rates.append(f"{ratio:.2f}x")
        steps = [str(run.accumulate), str(run.steps), f"{run.real_tokens / max(run.steps, 1):,.0f}"]
        memory = [f"{run.padding_ratio:.1%}", f"{run.microbatch_ms:.0f}", f"{run.peak_tokens:,}", human(run.peak_attn)]
        rows.append([name, *steps, *rates, *memory])
    print(markdown_table(headers, rows))
    base_loss = losses.get("padded")
    headers = ["mode", *(f"loss @ {human(m)} tok" for m in marks), "vs padded (last)"]
    rows = []
    for name, values in losses.items():
        delta = f"{values[-1] / base_loss[-1] - 1:+.1%}" if base_loss else "n/a"
        rows.append([name, *(f"{v:.4f}" for v in values), delta])
    print("\nHeld-out loss (the same evaluation samples for every mode; the last column is after the whole epoch,")
    print("i.e. after exactly the same training samples):\n")
    print(markdown_table(headers, rows))


def report_targets(runs: dict[str, ModeRun], losses: dict[str, list[float]], tolerance: float) -> None:
    """Check the issue's targets on one profile (wall-clock rates) and print a PASS / MISS line for each."""
    base = runs.get("padded")
    if base is None or not base.rate():
        return
    checks = []
    if HEADLINE in runs:
        checks.append((f"{HEADLINE} >= 2.5x padded (set against the masked baseline of earlier versions)",
                       runs[HEADLINE].rate() / base.rate() >= 2.5))  # fmt: skip
        checks.append((f"{HEADLINE} padding <= 2%", runs[HEADLINE].padding_ratio <= 0.02))
    if "dynamic" in runs:
        checks.append(("dynamic >= 1.5x padded (idem)", runs["dynamic"].rate() / base.rate() >= 1.5))
    final = {name: values[-1] / losses["padded"][-1] - 1 for name, values in losses.items()}
    worst = max(final.values(), key=abs)
    label = f"final loss of every mode within {tolerance:.0%} of padded (worst {worst:+.1%}"
    if "padded, other order" in final:
        label += f"; padded in another order alone: {final['padded, other order']:+.1%}"
    checks.append((label + ")", abs(worst) <= tolerance))
    for label, ok in checks:
        print(f"target {label}: {'PASS' if ok else 'MISS'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="24k real tokens per mode and profile (< 3 minutes)")
    size.add_argument("--smoke", action="store_true", help="tiny model and data (tests; seconds)")
    parser.add_argument("--model", default="reference", choices=["reference", "hf"])
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=list(PROFILES))
    parser.add_argument("--modes", nargs="+", default=None, choices=["padded", "dynamic", *PACKING_ALGORITHMS],
                        help="a subset: padded, dynamic, packing algorithm names (default: all)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=None, help="real tokens of the epoch every mode trains on")
    parser.add_argument("--rounds", type=int, default=None, help="interleaving rounds (default: ~1 packed step each)")
    parser.add_argument("--loss-tolerance", type=float, default=0.03, help="final-loss target, relative to padded")
    parser.add_argument("--max-tokens", type=int, default=None, help="token budget of a microbatch")
    parser.add_argument("--batch-size", type=int, default=None, help="padded baseline (default: same budget)")
    parser.add_argument("--tasks", nargs="+", default=["sort"], choices=SYNTHETIC_TASKS,
                        help="synthetic tasks (lengths, hence throughput, do not depend on them)")  # fmt: skip
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (constant after warmup)")
    parser.add_argument("--warmup", type=int, default=None, help="linear warmup, in optimizer steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (the same for every mode)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-match-steps", dest="match_steps", action="store_false",
                        help="no accumulation: every mode steps the optimizer after each microbatch")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="torch.profiler top ops of padded and packed steps")
    parser.add_argument("--masked", action="store_true", help="also the baselines with a dense padding mask")
    args = parser.parse_args(argv)
    size_of = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    for key in ("tokens", "max_tokens", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, size_of[key])
    for key in ("preset", "median", "max_len", "checkpoints", "eval"):
        setattr(args, key, size_of[key])
    args.vocab_size = 128 if args.smoke else 512
    if args.max_tokens < args.max_len:
        parser.error(f"--max-tokens must be >= the longest sample ({args.max_len}), got {args.max_tokens}")
    for key in ("tokens", "max_tokens", "threads", *(("rounds",) if args.rounds is not None else ())):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    probe = build_module(args.model, preset=args.preset, vocab_size=args.vocab_size, max_seq_len=args.max_tokens, lr=1)
    print(f"# bench_train: {args.model} model ({args.preset} sizes, {num_parameters(probe) / 1e6:.2f}M parameters), "
          f"fp32, CPU; synthetic task {'+'.join(args.tasks)}; AdamW lr {args.lr:g}, warmup {args.warmup} steps\n"
          f"{machine_summary()}")  # fmt: skip
    headline: dict[str, list[float]] = {}
    for profile in args.profiles:
        runs, losses = run_profile(profile, args)
        report_targets(runs, losses, args.loss_tolerance)
        for base in ("dynamic", "padded"):
            if base in runs and HEADLINE in runs and (base not in headline or profile == "power_law"):
                headline[base] = [runs[HEADLINE].rate(clock) / runs[base].rate(clock) for clock in ("cpu", "wall")]
        if args.profile:  # after the figures: the profiled microbatches run under the profiler's overhead
            profile_steps(runs, ("padded", HEADLINE))
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    for base, (cpu, wall) in headline.items():  # padded last: the last line is the headline
        print(f"packed/{base} real-token throughput by CPU time (maskless {base}): {cpu:.2f}x")
        print(f"packed/{base} real-token throughput: {wall:.2f}x")


if __name__ == "__main__":
    main()
