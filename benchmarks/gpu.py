"""The GPU benchmark: one self-contained script for a lent CUDA machine (written for an H200, torch 2.11).

Two tables, in under 8 minutes on an H200:

1. **Attention** forward + backward over one packed row of ``--attn-tokens`` tokens split into 16 and 256
   documents (12 heads x 64, bf16): every varlen backend lit_seqpack finds there (``torch_varlen``, ``sdpa`` per
   document, ``flash_attn`` when installed), one SDPA call with a dense block-diagonal mask, and the same
   documents padded to ``[docs, longest]`` (``benchmarks/bench_attention.py``'s cases, CUDA-synchronised).
2. **Training** of the ``100m`` reference model (~100M parameters, bf16 weights and activations, AdamW) on
   the embedded synthetic task with power-law lengths: one epoch over the same samples per mode, the modes
   interleaved in rounds, through the library's path (lit_seqpack batch samplers + ``PlannedDataset`` +
   collators in a ``torch.utils.data.DataLoader`` with workers, then ``ReferenceLM.training_step``). Modes:
   padded baseline (same mean token budget), dynamic, and packing with every varlen backend available there
   (``flash_attn``, ``torch_varlen``, ``sdpa`` per document). Columns: real tokens/s, the ratio to padded,
   padding, step time, peak memory
   of a step above its start (activations, gradients, optimizer temporaries: ``torch.cuda.max_memory_allocated``),
   and the held-out loss after the epoch. Optimizer steps hold about as many real tokens in every mode
   (the padded and dynamic plans accumulate microbatches to match packing's), so the losses are comparable.
   The weights are cast to bf16 rather than trained under ``torch.autocast``: under autocast the reference
   model's RoPE (float32 cos/sin) turns q and k back to float32 while v stays bf16, and packed attention
   rejects the mix (a bug reported to the model's owner).

It needs only torch, numpy and lightning (no torchdata, omegaconf, jsonargparse, flash-attn or network), and
says which optional configuration packages the imports pulled in. ``--device cpu --tiny`` runs the same code path
on a CPU in seconds (tiny model and data, fp32), which is how it is tested; it never runs in CI.

    python benchmarks/gpu.py                      # on the GPU machine
    python benchmarks/gpu.py --device cpu --tiny  # code-path check anywhere
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import warnings

import numpy as np
import torch
from _common import (  # benchmarks/ is sys.path[0] when run as a script
    build_module,
    fair_batch_size,
    markdown_table,
    matched_accumulation,
    num_parameters,
    profile_dataset,
    real_tokens_per_microbatch,
)
from _train_loop import ModeRun, held_out_loss
from bench_attention import attention_cases, doc_lengths, median_times

from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.indexed.samplers import DynamicBatchSampler, PackedBatchSampler, PaddedBatchSampler
from lit_seqpack.model.attention import available_backends

SIZES = {  # preset, vocab, median / longest sample, max_tokens, real tokens per mode, attention row, repeats
    "gpu": dict(preset="100m", vocab=32000, median=512, max_len=4096, max_tokens=16384, tokens=3_000_000,
                attn_tokens=16384, repeats=10, heads=12, head_dim=64, workers=3, eval=256, round=64),
    "tiny": dict(preset="tiny", vocab=128, median=16, max_len=128, max_tokens=256, tokens=3_000,
                 attn_tokens=512, repeats=2, heads=4, head_dim=16, workers=0, eval=8, round=8),
}  # fmt: skip


def optional_imports() -> str:
    """Which optional configuration packages the imports so far pulled in (the GPU machine has neither)."""
    found = sorted({name.split(".")[0] for name in sys.modules} & {"omegaconf", "jsonargparse", "torchdata"})
    return ", ".join(found) or "none"


def attention_table(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Table 1: varlen backends against a dense mask and against padding (ms and speed-ups)."""
    counts, results = (16, 256), {}
    for num_docs in counts:
        lengths = doc_lengths(num_docs, args.attn_tokens, seed=0)
        cases = attention_cases(lengths, args.heads, args.head_dim, device, dtype)
        for name, seconds in median_times(cases, args.repeats, device).items():
            results.setdefault(name, {})[num_docs] = seconds
    headers = ["layout", *(f"{n} docs ms" for n in counts), *(f"x padded ({n})" for n in counts)]
    rows = [
        [name, *(f"{t[n] * 1e3:.2f}" for n in counts), *(f"{results['padded'][n] / t[n]:.2f}x" for n in counts)]
        for name, t in results.items()
    ]
    print(f"\n## Attention fwd+bwd: {args.attn_tokens} tokens, {args.heads} heads x {args.head_dim}, {dtype}, "
          f"median of {args.repeats}\n")  # fmt: skip
    print(markdown_table(headers, rows))


def planned_loader(
    dataset, spec: dict, *, round_to: int, workers: int, pin: bool, accumulate: int = 1, shuffle: bool = True
):
    """A DataLoader over ``dataset`` planned by a lit_seqpack batch sampler and collated into the batch contract.

    What ``SeqPackDataModule`` builds, without torchdata (absent on the GPU machine): a plain ``DataLoader``.
    """
    knobs = {"sequence_length_round": round_to, "shuffle": shuffle, "loss_tokens": dataset.loss_tokens,
             "accumulate_grad_batches": accumulate}  # fmt: skip
    if spec["mode"] == "padded":
        sampler = PaddedBatchSampler(dataset.lengths, batch_size=spec["batch_size"], **knobs)
        collate = PaddedCollator(pad_to_multiple_of=round_to)
    elif spec["mode"] == "dynamic":
        sampler = DynamicBatchSampler(dataset.lengths, max_tokens=spec["max_tokens"], **knobs)
        collate = PaddedCollator(pad_to_multiple_of=round_to)
    else:
        sampler = PackedBatchSampler(dataset.lengths, max_tokens=spec["max_tokens"], **knobs)
        collate = PackedCollator(pad_to_multiple_of=round_to)
    return torch.utils.data.DataLoader(
        PlannedDataset(dataset), batch_sampler=sampler, collate_fn=collate, num_workers=workers, pin_memory=pin
    )


def build_runs(
    args: argparse.Namespace, dataset, device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, ModeRun], str]:
    """One ``ModeRun`` per mode (same initial weights), optimizer steps matched in real tokens; and a summary."""
    batch_size, mean = fair_batch_size(dataset.lengths, args.max_tokens, seed=0, round_to=args.round)
    specs = {
        "padded": {"mode": "padded", "batch_size": batch_size},
        "dynamic": {"mode": "dynamic", "max_tokens": args.max_tokens},
    }
    for backend in available_backends(device, dtype):
        specs[f"packing {backend}"] = {"mode": "packing", "max_tokens": args.max_tokens, "backend": backend}
    per_microbatch = {
        name: real_tokens_per_microbatch(dataset.lengths, spec, seed=0, round_to=args.round)
        for name, spec in specs.items()
    }
    accumulation = matched_accumulation(per_microbatch, next(name for name in specs if name.startswith("packing")))
    runs = {}
    for name, spec in specs.items():
        torch.manual_seed(0)
        module = build_module("reference", preset=args.preset, vocab_size=args.vocab, max_seq_len=args.max_tokens,
                              lr=3e-4, attn_backend=spec.get("backend", "auto"))  # fmt: skip
        loader = planned_loader(dataset, spec, round_to=args.round, workers=args.workers, pin=device.type == "cuda",
                                accumulate=accumulation[name])  # fmt: skip
        runs[name] = ModeRun(name, module.to(device=device, dtype=dtype), loader, accumulate=accumulation[name],
                             device=device)  # fmt: skip
    summary = (
        f"{args.preset} reference model ({num_parameters(module) / 1e6:.1f}M parameters), "
        f"{dtype} weights and activations, padded batch_size {batch_size} (mean {mean:.0f} tokens per "
        f"microbatch), rows rounded to {args.round}"
    )
    return runs, summary


def training_table(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    """Table 2: one epoch over the same samples per mode, interleaved; real tokens/s, memory, loss."""
    sizes = {"vocab_size": args.vocab, "median_length": args.median, "max_length": args.max_len}
    stream = profile_dataset("power_law", num_samples=args.tokens // 6 + 1, seed=0, **sizes)
    count = int(np.searchsorted(np.cumsum(stream.lengths), args.tokens)) + 1
    dataset = profile_dataset("power_law", num_samples=count, seed=0, **sizes)
    total = int(dataset.lengths.sum())
    runs, summary = build_runs(args, dataset, device, dtype)
    rounds = max(2, total // (4 * args.max_tokens))
    print(
        f"\n## Training: {summary}; power-law lengths ({count:,} samples, {total:,} tokens, max "
        f"{dataset.lengths.max()}), max_tokens {args.max_tokens}; one epoch per mode in {rounds} rounds\n"
    )
    for index in range(1, rounds + 1):
        for name in list(runs)[index % len(runs) :] + list(runs)[: index % len(runs)]:
            runs[name].train_until(total * index // rounds)
    eval_set = profile_dataset("power_law", num_samples=args.eval, seed=1, **sizes)
    eval_spec = {"mode": "packing", "max_tokens": args.max_tokens}
    eval_batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        for batch in planned_loader(eval_set, eval_spec, round_to=args.round, workers=0, pin=False, shuffle=False)
    ]
    print_training(runs, eval_batches, device)


def print_training(runs: dict[str, ModeRun], eval_batches: list, device: torch.device) -> None:
    """The training table; the held-out loss (the same packed samples for every mode) is computed here."""
    base = runs["padded"].rate()
    headers = ["mode", "accum", "opt steps", "real tok/s", "x padded", "padding", "mb ms", "peak mb GiB",
               "peak mb tokens", "held-out loss"]  # fmt: skip
    rows = []
    gib = device.type == "cuda"
    for name, run in runs.items():
        loss = held_out_loss(run.module, eval_batches)
        memory = f"{run.peak_bytes / 2**30:.2f}" if gib else "n/a"
        rows.append([name, str(run.accumulate), str(run.steps), f"{run.rate():,.0f}", f"{run.rate() / base:.2f}x",
                     f"{run.padding_ratio:.1%}", f"{run.microbatch_ms:.1f}", memory, f"{run.peak_tokens:,}",
                     f"{loss:.4f}"])  # fmt: skip
    print(markdown_table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and data (a code-path check, seconds)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-training", action="store_true")
    args = parser.parse_args(argv)
    for key, value in SIZES["tiny" if args.tiny else "gpu"].items():
        setattr(args, key, value)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is visible; use --device cpu --tiny for a code-path check")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: one thread avoids OpenMP contention
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    print(f"# lit_seqpack GPU benchmark: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"backends {available_backends(device, dtype)}")  # fmt: skip
    started = time.perf_counter()
    if not args.skip_attention:
        attention_table(args, device, dtype)
    if not args.skip_training:
        training_table(args, device, dtype)
    print(f"\noptional packages imported by lit_seqpack's model, data and planning modules: {optional_imports()}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
