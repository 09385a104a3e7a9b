"""Benchmark scale: memory and time of planning 10M sequences, and the DataLoader's share of an 8k-token step.

Three Markdown tables:

1. **Planning at scale.** Each mode plans one epoch of ``--sequences`` lognormal lengths (median 512, sigma 1,
   clipped to [16, 4096]) for ``--world`` ranks x ``--accumulate`` accumulation, in a fresh subprocess: the peak
   resident memory of ``build_plan`` above what the process held before (the lengths and a warmed-up planner;
   the peak is reset through ``/proc/self/clear_refs``), that peak per sequence, what the finished ``Plan``
   keeps per sequence, and the seconds.
2. **DataLoader overhead.** ``SeqPackDataModule`` (packing, ``max_tokens=--tokens``, the embedded synthetic task)
   feeds a ``ReferenceLM`` (``--model``: the ``demo`` or ``100m`` preset) in a plain training loop on CPU: the
   time the loop waits for the next batch (fetch + collate, in the main process with 0 workers, overlapped with
   the step otherwise) against the model step (forward, backward, AdamW). The overhead column is wait / step.

3. **Per-rank planning.** What one rank process pays (``--rank-sizes`` samples, default ``--sequences``, x
   ``--rank-worlds`` ranks, one fresh
   subprocess each, lengths held as ``uint16``): the batch sampler of the last rank built from the lengths, its
   ``len()``, the first batch, and a resume at mid-epoch (a fresh sampler seeking its window) -- seconds, the
   peak resident memory above the process before (bytes per sample) and the process's whole peak (torch
   included; "CPU s" is the process's CPU time to the first batch, which a loaded box inflates less than the
   wall time); ``dm`` rows go through ``SeqPackDataModule`` on a ``SyntheticInstructionDataset`` of the same length
   law (built before the measurement; its lengths are known without reading the samples).

    .venv/bin/python benchmarks/bench_scale.py                      # all tables (10M sequences, demo model)
    .venv/bin/python benchmarks/bench_scale.py --only rank --rank-sizes 100000000 --rank-worlds 4096
    .venv/bin/python benchmarks/bench_scale.py --only plan --sequences 1000000
    .venv/bin/python benchmarks/bench_scale.py --only loader --model 100m --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence

LOW, HIGH, MEDIAN = 16, 4096, 512


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def plan_child(mode: str, sequences: int, max_tokens: int, world: int, accumulate: int) -> dict[str, float]:
    """Runs in a fresh interpreter: plan one epoch and measure memory and time (returned as a dict)."""
    import numpy as np

    from lit_seqpack.planning.plan import PlanConfig, build_plan

    rng = np.random.default_rng(0)
    high = min(HIGH, max_tokens)  # a smaller budget (smoke runs) clips the lengths to it
    median = min(MEDIAN, high // 2)
    lengths = np.clip(np.round(rng.lognormal(np.log(median), 1.0, sequences)), min(LOW, high), high).astype(np.int64)
    knobs = {"batch_size": 16} if mode == "padded" else {"max_tokens": max_tokens}
    config = PlanConfig(mode=mode, world_size=world, accumulate_grad_batches=accumulate, **knobs)
    build_plan(lengths[:10_000], config, epoch=0)  # compile the kernels before measuring
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = _rss_kib("VmRSS")
    start = time.perf_counter()
    plan = build_plan(lengths, config, epoch=0)
    seconds = time.perf_counter() - start
    peak, after = _rss_kib("VmHWM"), _rss_kib("VmRSS")
    return {
        "seconds": seconds,
        "peak_mib": (peak - before) / 1024,
        "peak_bytes_per_sequence": (peak - before) * 1024 / sequences,
        "kept_bytes_per_sequence": (after - before) * 1024 / sequences,
        "microbatches": plan.stats.num_microbatches,
        "utilization": plan.stats.utilization,
    }


def plan_table(args: argparse.Namespace) -> str:
    rows = []
    for mode in ("packing", "dynamic", "padded"):
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_scale import plan_child; "
            f"print(json.dumps(plan_child({mode!r}, {args.sequences}, {args.tokens}, {args.world}, {args.accumulate})))"
        )
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if child.returncode:
            raise RuntimeError(f"planning {mode} failed:\n{child.stderr[-3000:]}")
        r = json.loads(child.stdout.strip().splitlines()[-1])
        rows.append(
            [
                mode,
                f"{r['seconds']:.1f}",
                f"{r['peak_mib']:.0f}",
                f"{r['peak_bytes_per_sequence']:.0f}",
                f"{r['kept_bytes_per_sequence']:.0f}",
                f"{r['microbatches']:,}",
                f"{r['utilization']:.3f}",
            ]
        )
    high = min(HIGH, args.tokens)
    title = (
        f"Planning {args.sequences:,} lognormal lengths (median {min(MEDIAN, high // 2)}, clip [{min(LOW, high)}, "
        f"{high}]), "
        f"max_tokens={args.tokens} (padded: batch_size=16), {args.world} ranks x {args.accumulate} accumulation"
    )
    headers = ["mode", "seconds", "peak MiB", "peak B/seq", "plan B/seq", "microbatches", "utilization"]
    return f"{title}\n\n{_table(headers, rows)}"


def _compact_lognormal(sequences: int, high: int, median: int) -> object:
    """Lognormal lengths as ``uint16``, drawn 4M at a time (no 100M float64 temporary)."""
    import numpy as np

    rng, out = np.random.default_rng(0), np.empty(sequences, dtype=np.uint16)
    for start in range(0, sequences, 1 << 22):
        size = min(1 << 22, sequences - start)
        out[start : start + size] = np.clip(np.round(rng.lognormal(np.log(median), 1.0, size)), min(LOW, high), high)
    return out


def rank_child(path: str, sequences: int, max_tokens: int, world: int, accumulate: int) -> dict[str, float]:
    """Runs in a fresh interpreter: one rank's sampler (``path`` "sampler") or DataModule ("dm"), timed and measured."""
    import gc

    from lit_seqpack import PlannedBatchSampler, SeqPackDataModule, SyntheticInstructionDataset
    from lit_seqpack.parallel import DataParallelLayout
    from lit_seqpack.planning.plan import PlanConfig

    high = min(HIGH, max_tokens)
    median = min(MEDIAN, high // 2)

    def synthetic(n: int) -> SyntheticInstructionDataset:  # the same lognormal law; lengths known without a scan
        low = min(LOW, high)
        return SyntheticInstructionDataset(num_samples=n, median_length=median, min_length=low, max_length=high)

    lengths = _compact_lognormal(sequences, high, median) if path == "sampler" else synthetic(sequences)
    if path == "dm":
        _ = lengths.lengths  # the dataset computes its lengths lazily, once: part of building it, not of the DataModule
    config = PlanConfig(max_tokens=max_tokens, world_size=world, accumulate_grad_batches=accumulate)

    def build(values: object, plan: PlanConfig) -> PlannedBatchSampler:
        if path == "sampler":
            return PlannedBatchSampler(values, plan, rank=plan.world_size - 1, verify_plan=False)
        data = SeqPackDataModule(source=values, max_tokens=max_tokens)
        data.setup("fit")
        data.pipeline.layout = DataParallelLayout(plan.world_size, plan.world_size - 1, plan.accumulate_grad_batches)
        data.train_dataloader()
        return data.pipeline.train_sampler

    small = lengths[:10_000] if path == "sampler" else synthetic(10_000)
    next(iter(build(small, PlanConfig(max_tokens=max_tokens, world_size=1))))  # imports, compiled kernels
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    before = _rss_kib("VmRSS")
    start, cpu = time.perf_counter(), time.process_time()
    sampler = build(lengths, config)
    count = len(sampler)
    setup = time.perf_counter() - start
    next(iter(sampler))
    first, first_cpu = time.perf_counter() - start, time.process_time() - cpu
    state = {**sampler.state_dict(), "position": count // 2}
    del sampler
    gc.collect()
    start = time.perf_counter()
    resumed = build(lengths, config)
    resumed.load_state_dict(state)
    next(iter(resumed))
    resume = time.perf_counter() - start
    peak = _rss_kib("VmHWM")
    return {
        "setup_s": setup,
        "first_s": first,
        "first_cpu_s": first_cpu,
        "resume_s": resume,
        "peak_bytes_per_sample": (peak - before) * 1024 / sequences,
        "peak_gib": peak / 2**20,
        "window": getattr(getattr(resumed, "lazy_plan", None), "window", sequences),  # older versions: the epoch
        "steps": count // accumulate,
        "utilization": float(resumed._lengths.sum(dtype="int64")) / (count * world * max_tokens),
    }


def rank_table(args: argparse.Namespace) -> str:
    rows = []
    for sequences in args.rank_sizes:
        for world in args.rank_worlds:
            for path in args.rank_paths:
                code = (
                    "import json, sys; sys.path.insert(0, 'benchmarks'); from bench_scale import rank_child; "
                    f"print(json.dumps(rank_child({path!r}, {sequences}, {args.tokens}, {world}, {args.accumulate})))"
                )
                child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                if child.returncode:
                    raise RuntimeError(f"rank planning failed:\n{child.stderr[-3000:]}")
                r = json.loads(child.stdout.strip().splitlines()[-1])
                rows.append(
                    [
                        f"{sequences:,} x {world} ({path})",
                        f"{r['window']:,}",
                        f"{r['steps']:,}",
                        f"{r['utilization']:.4f}",
                        f"{r['setup_s']:.1f}",
                        f"{r['first_s']:.1f}",
                        f"{r['first_cpu_s']:.1f}",
                        f"{r['resume_s']:.1f}",
                        f"{r['peak_bytes_per_sample']:.1f}",
                        f"{r['peak_gib']:.2f}",
                    ]
                )
    title = (
        f"One rank's plan (the last rank), lognormal lengths (median {MEDIAN}, clip [{LOW}, {HIGH}]), "
        f"max_tokens={args.tokens}, accumulation {args.accumulate}, window=None (auto), first_fit_decreasing"
    )
    headers = ["samples x ranks (path)", "window", "steps", "utilization", "len() s", "1st batch s", "1st batch CPU s"]
    headers += ["resume s"]
    headers += ["peak B/sample", "process peak GiB"]
    return f"{title}\n\n{_table(headers, rows)}"


def _step_fn(model: object, optimizer: object) -> object:
    import torch

    def step(batch: dict) -> None:
        loss = model.seqpack_step(batch, "train")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cpu.synchronize()

    return step


def loader_rows(args: argparse.Namespace) -> list[list[str]]:
    import torch

    from lit_seqpack import ReferenceLM, SeqPackDataModule, SyntheticInstructionDataset
    from lit_seqpack.model.reference import REFERENCE_PRESETS

    torch.manual_seed(0)
    sizes = REFERENCE_PRESETS[args.model] | {"vocab_size": 512}
    model = ReferenceLM(**sizes, max_seq_len=args.tokens, lr_schedule="constant", attn_backend="sdpa")
    model.seqpack_verify_packing = lambda batch: None  # the one-time isolation probe is not a step
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _step_fn(model, optimizer)
    longest = min(HIGH, args.tokens)
    synthetic = {"num_samples": 20_000, "vocab_size": 512, "median_length": min(MEDIAN, longest // 2)}
    synthetic |= {"max_length": longest, "seed": 0}
    rows = []
    for workers in args.workers:
        data = SeqPackDataModule(
            source=SyntheticInstructionDataset(**synthetic), max_tokens=args.tokens, num_workers=workers
        )
        loader = iter(data.train_dataloader())
        step(next(loader))  # warm-up: workers start, first batch, allocator
        waits, steps, tokens = [], [], 0
        for _ in range(args.steps):
            start = time.perf_counter()
            batch = next(loader)
            fetched = time.perf_counter()
            step(batch)
            waits.append(fetched - start)
            steps.append(time.perf_counter() - fetched)
            tokens += batch["num_real_tokens"]
        wait, compute = sum(waits) / len(waits), sum(steps) / len(steps)
        rows.append(
            [
                f"{args.model}, {workers} worker(s)",
                f"{wait * 1e3:.1f}",
                f"{compute * 1e3:.0f}",
                f"{100 * wait / compute:.2f} %",
                f"{tokens / len(steps):.0f}",
            ]
        )
        del loader
    return rows


def loader_table(args: argparse.Namespace) -> str:
    import torch

    torch.set_num_threads(args.threads)
    rows = loader_rows(args)
    title = (
        f"DataLoader wait vs model step at max_tokens={args.tokens} (packing, synthetic lognormal median {MEDIAN}), "
        f"ReferenceLM {args.model}, {args.steps} steps after one warm-up, {args.threads} torch thread(s)"
    )
    headers = ["model, loader", "wait ms/step", "step ms", "overhead", "real tokens/step"]
    return f"{title}\n\n{_table(headers, rows)}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["plan", "loader", "rank"], default=None, help="run one table")
    parser.add_argument("--rank-sizes", type=int, nargs="+", default=None, help="samples (default --sequences)")
    parser.add_argument("--rank-worlds", type=int, nargs="+", default=[8, 4096], help="ranks, rank table")
    parser.add_argument("--rank-paths", nargs="+", choices=["sampler", "dm"], default=["sampler", "dm"])
    parser.add_argument("--sequences", type=int, default=10_000_000, help="sequences to plan")
    parser.add_argument("--tokens", type=int, default=8192, help="max_tokens of a microbatch")
    parser.add_argument("--world", type=int, default=8, help="ranks planned for")
    parser.add_argument("--accumulate", type=int, default=4, help="accumulation planned for")
    parser.add_argument("--model", choices=["demo", "100m"], default="demo", help="ReferenceLM preset")
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per loader setting")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="num_workers settings")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="torch threads")
    args = parser.parse_args()
    args.rank_sizes = args.rank_sizes or [args.sequences]
    load = "/".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, load {load}\n")
    if args.only in (None, "plan"):
        print(plan_table(args), end="\n\n")
    if args.only in (None, "rank"):
        print(rank_table(args), end="\n\n")
    if args.only in (None, "loader"):
        print(loader_table(args))


if __name__ == "__main__":
    main()
