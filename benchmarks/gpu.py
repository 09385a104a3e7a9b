"""The GPU benchmark: one command for a lent CUDA machine (written for one H200, torch 2.11, under 8 minutes).

    python benchmarks/gpu.py --run-gpu-tests          # the benchmark, then the gpu-marked tests; JSON to $OUT
    python benchmarks/gpu.py --device cpu --tiny      # the same code path on a CPU in seconds (the tests run it)

Training throughput of a ~1B Llama-style reference decoder (``--preset 1b``: 22 layers, width 2048, 32 heads, 4 kv
heads, vocab 32000; bf16 weights and activations, AdamW) on the embedded synthetic task with lognormal lengths
(median 512, sigma 1, at most 4096 tokens), through the library's path (lit_seqpack batch samplers +
``PlannedDataset`` + collators in a ``DataLoader`` with workers, then ``ReferenceLM.training_step``). Every mode
trains its own copy of the same initial weights over the same samples, interleaved in rounds of real tokens, with
optimizer steps matched in real tokens (modes with fewer real tokens per microbatch accumulate more). Rows:

* ``padded``: ``batch_size`` samples padded on the right to the longest (``batch_size``: the largest whose mean
  microbatch fits ``max_tokens``); maskless: right padding runs SDPA with ``is_causal`` (its flash kernel);
* ``dynamic``: ``[rows, L]`` blocks with ``rows x L <= max_tokens``, maskless too;
* ``packing <backend>``: rows of ``max_tokens`` tokens, one row per varlen backend found (``flash_attn``,
  ``torch_varlen`` = ``torch.nn.attention.varlen``, ``sdpa`` per document, ``flex`` = FlexAttention with a
  document block mask, its kernel ``torch.compile``-d on CUDA; on a CPU the flex row is refused by name: no
  FlexAttention backward there);
* ``no-padding bound``: the packing plan's documents with no padding and no cross-document work: the model's
  step on exactly the real tokens with attention taken out, plus the fastest varlen kernel alone on exactly the
  documents (``_gpu_rows.BoundRun``). How close packing comes to the work that cannot be avoided.

Columns: real tokens/s, the ratio to padded and to the bound, padding, microbatch and optimizer-step time, MFU
(useful model FLOPs of the real tokens per second, ``lit_seqpack.metrics.flops.training_flops``: causal attention
per document, padding not counted, against the device's dense bf16 peak from ``lit_seqpack.metrics.flops.PEAK_FLOPS``:
989.4 TFLOP/s for an H100 SXM or H200, ``--peak-tflops`` to override), peak memory of a microbatch above its start
(activations, gradients, optimizer temporaries), the held-out loss after the rounds (the same packed samples for
every mode) and the status (a failing mode is reported and dropped, the others go on). An attention table
(``bench_attention.py``'s layouts, CUDA-synchronised) comes first; the training table is printed last and, with
the attention table, the gpu tests' summary and the settings, written as JSON to ``--out`` (default
``$OUT/gpu.json`` when ``$OUT`` is set). Sized to end within 8 minutes on an H200 (unmeasured: no GPU was lent
yet): the training rounds stop after ``--budget-s`` (200 s) even if the epoch is not done (every mode has then
trained the same rounds), the tests after ``--gpu-tests-timeout`` (150 s).

It needs torch, numpy, lightning and numba (no torchdata, omegaconf, jsonargparse, flash-attn or network) and
prints which optional configuration packages the imports pulled in.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

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
from _gpu_rows import BOUND, BoundRun, flops_per_real_token, peak_flops, run_gpu_tests, short_error, train_rounds
from _train_loop import ModeRun, held_out_loss
from bench_attention import attention_cases, doc_lengths, median_times

from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler
from lit_seqpack.model.attention import available_backends
from lit_seqpack.model.reference import REFERENCE_PRESETS, ReferenceConfig
from lit_seqpack.planning.config import PlanConfig

ROOT = Path(__file__).resolve().parents[1]
SIZES = {  # preset, vocab, median / longest sample, max_tokens, real tokens per mode, attention row, repeats, ...
    "gpu": dict(preset="1b", vocab=32000, median=512, max_len=4096, max_tokens=8192, tokens=1_000_000,
                attn_tokens=16384, repeats=10, heads=32, head_dim=64, workers=3, eval=64, round=64, budget=200.0),
    "tiny": dict(preset="tiny", vocab=128, median=16, max_len=128, max_tokens=256, tokens=3_000,
                 attn_tokens=512, repeats=2, heads=4, head_dim=16, workers=0, eval=8, round=8, budget=120.0),
}  # fmt: skip


def optional_imports() -> str:
    """Which optional configuration packages the imports so far pulled in (the GPU machine has neither)."""
    found = sorted({name.split(".")[0] for name in sys.modules} & {"omegaconf", "jsonargparse", "torchdata"})
    return ", ".join(found) or "none"


def attention_table(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Attention layouts fwd+bwd over the same documents (ms, and speed-up against maskless padding)."""
    counts, results = (16, 256), {}
    for num_docs in counts:
        try:
            cases = attention_cases(doc_lengths(num_docs, args.attn_tokens, seed=0), args.heads, args.head_dim,
                                    device, dtype)  # fmt: skip
            working = {}
            for name, case in cases.items():  # a case that fails here (a kernel, memory) is reported and dropped
                try:
                    case()
                    working[name] = case
                except Exception as err:  # noqa: BLE001
                    print(f"attention {name!r}, {num_docs} documents: {short_error(err)}")
            for name, seconds in median_times(working, args.repeats, device).items():
                results.setdefault(name, {})[num_docs] = seconds
        except Exception as err:  # noqa: BLE001 - the training table still runs
            print(f"attention table, {num_docs} documents: {short_error(err)}")
    if "padded" not in results:
        return []
    base = results["padded"]
    headers = ["layout", *(f"{n} docs ms" for n in counts), *(f"x padded ({n})" for n in counts)]
    rows, cells = [], []
    for name, times in results.items():
        ms = [times[n] * 1e3 if n in times else None for n in counts]
        ratios = [base[n] / times[n] if n in times and n in base else None for n in counts]
        rows.append({"layout": name, "ms": dict(zip(counts, ms, strict=True)),
                     "x_padded": dict(zip(counts, ratios, strict=True))})  # fmt: skip
        cells.append([name, *("n/a" if x is None else f"{x:.2f}" for x in ms),
                      *("n/a" if x is None else f"{x:.2f}x" for x in ratios)])  # fmt: skip
    print(f"\n## Attention fwd+bwd: {args.attn_tokens} tokens, {args.heads} heads x {args.head_dim}, {dtype}, "
          f"median of {args.repeats} (padded: right padding, causal, no mask)\n")  # fmt: skip
    print(markdown_table(headers, cells))
    return rows


def planned_loader(
    dataset, spec: dict, *, round_to: int, workers: int, pin: bool, accumulate: int = 1, shuffle: bool = True
):
    """A DataLoader over ``dataset`` planned by a lit_seqpack batch sampler and collated into the batch contract.

    What ``SeqPackDataModule`` builds, without torchdata (absent on the GPU machine): a plain ``DataLoader``.
    """
    knobs = {"sequence_length_round": round_to, "shuffle": shuffle, "accumulate_grad_batches": accumulate}
    budget = {"batch_size": spec["batch_size"]} if spec["mode"] == "padded" else {"max_tokens": spec["max_tokens"]}
    config = PlanConfig(mode=spec["mode"], **budget, **knobs)
    sampler = PlannedBatchSampler(dataset.lengths, config, loss_tokens=dataset.loss_tokens)
    if spec["mode"] == "packing":
        collate = PackedCollator(pad_to_multiple_of=round_to)
    else:
        collate = PaddedCollator(pad_to_multiple_of=round_to)
    return torch.utils.data.DataLoader(
        PlannedDataset(dataset), batch_sampler=sampler, collate_fn=collate, num_workers=workers, pin_memory=pin
    )


def mode_specs(args: argparse.Namespace, dataset, device: torch.device, dtype: torch.dtype) -> dict[str, dict]:
    """DataLoader specs of every row: padded, dynamic, packing per backend, and the bound."""
    batch_size, args.mean_padded = fair_batch_size(dataset.lengths, args.max_tokens, seed=0, round_to=args.round)
    specs = {"padded": {"mode": "padded", "batch_size": batch_size}, "dynamic": {"mode": "dynamic"}}
    backends = available_backends(device, dtype)
    for backend in backends:
        specs[f"packing {backend}"] = {"mode": "packing", "backend": backend}
    specs[BOUND] = {"mode": "packing", "backends": backends, "round": 1}  # the fastest kernel, no padding tail
    for spec in specs.values():
        if spec["mode"] != "padded":
            spec.setdefault("max_tokens", args.max_tokens)
    return specs


def build_runs(args, dataset, specs: dict, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict[str, str]]:
    """One run per row (same initial weights), optimizer steps matched in real tokens; rows that fail to build."""
    per_microbatch = {
        name: real_tokens_per_microbatch(dataset.lengths, spec, seed=0, round_to=args.round)
        for name, spec in specs.items()
    }
    accumulation = matched_accumulation(per_microbatch, next(name for name in specs if name.startswith("packing")))
    runs, failed = {}, {}
    for name, spec in specs.items():
        try:
            torch.manual_seed(0)
            with torch.device(device):  # initialised where it trains: no host copy of a 1B model
                module = build_module(
                    "reference",
                    preset=args.preset,
                    vocab_size=args.vocab,
                    max_seq_len=args.max_tokens,
                    lr=3e-4,
                    attn_backend=spec.get("backend", "auto"),
                )
            loader = planned_loader(dataset, spec, round_to=spec.get("round", args.round), workers=args.workers,
                                    pin=device.type == "cuda", accumulate=accumulation[name])  # fmt: skip
            kwargs = {"accumulate": accumulation[name], "device": device, "warmup": 2 if device.type == "cuda" else 1}
            module = module.to(dtype=dtype)
            if name == BOUND:
                runs[name] = BoundRun(name, module, loader, config=args.config, backends=spec["backends"], **kwargs)
            else:
                runs[name] = ModeRun(name, module, loader, **kwargs)
        except Exception as err:  # noqa: BLE001 - one failing row must not end the table
            failed[name] = short_error(err)
    return runs, failed


def training(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Train every row over the same samples, interleaved; the rows of the final table."""
    sizes = {"vocab_size": args.vocab, "median_length": args.median, "max_length": args.max_len}
    stream = profile_dataset("lognormal", num_samples=args.tokens // 6 + 1, seed=0, **sizes)
    count = int(np.searchsorted(np.cumsum(stream.lengths), args.tokens)) + 1
    dataset = profile_dataset("lognormal", num_samples=count, seed=0, **sizes)
    total = int(dataset.lengths.sum())
    specs = mode_specs(args, dataset, device, dtype)
    runs, failed = build_runs(args, dataset, specs, device, dtype)
    rounds = max(2, total // (4 * args.max_tokens))
    started = time.perf_counter()
    errors, done = train_rounds(runs, total, rounds, started + args.budget)
    failed |= errors
    eval_set = profile_dataset("lognormal", num_samples=args.eval, seed=1, **sizes)
    eval_loader = planned_loader(eval_set, {"mode": "packing", "max_tokens": args.max_tokens}, round_to=args.round,
                                 workers=0, pin=False, shuffle=False)  # fmt: skip
    eval_batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()} for b in eval_loader]
    flops = flops_per_real_token(args.config, dataset.lengths)
    peak, peak_source = peak_flops(device, args.peak_tflops)
    rows = [_row(name, runs.get(name), failed.get(name), eval_batches, flops, peak, device) for name in specs]
    base = {r["mode"]: r["real_tok_s"] for r in rows if r["real_tok_s"]}
    for r in rows:
        r["x_padded"] = r["real_tok_s"] / base["padded"] if r["real_tok_s"] and "padded" in base else None
        r["x_bound"] = r["real_tok_s"] / base[BOUND] if r["real_tok_s"] and BOUND in base else None
    return {
        "summary": f"{args.preset} reference model ({num_parameters_of(runs, args)} parameters), {dtype}, lognormal "
        f"lengths ({count:,} samples, {total:,} tokens, max {dataset.lengths.max()}), max_tokens {args.max_tokens}, "
        f"padded batch_size {specs['padded']['batch_size']} (mean {args.mean_padded:.0f} tokens a microbatch), "
        f"rows rounded to {args.round}; {done} of {rounds} rounds in {time.perf_counter() - started:.0f} s "
        f"(budget {args.budget:.0f} s); MFU: {flops / 1e9:.3f} GFLOP per real token against {peak_source}",
        "rows": rows,
        "flops_per_real_token": flops,
        "peak_flops": peak,
        "rounds": [done, rounds],
    }


def num_parameters_of(runs: dict[str, ModeRun], args: argparse.Namespace) -> str:
    module = next((run.module for run in runs.values() if run.module is not None), None)
    count = num_parameters(module) if module is not None else args.config.num_parameters()
    return f"{count / 1e6:.2f}M"


def _row(name, run, error, eval_batches, flops, peak, device) -> dict[str, Any]:
    """One row of the final table as a dict (``None`` where a figure does not apply)."""
    refused = error is not None and error.startswith("BackendUnavailableError")  # e.g. flex training on a CPU
    status = "ok" if error is None else f"{'refused' if refused else 'failed'}: {error}"
    row: dict[str, Any] = {"mode": name, "status": status, "real_tok_s": None}
    if run is None or not run.timed["microbatches"]:
        return row
    loss = None
    if name != BOUND and error is None:
        try:
            loss = held_out_loss(run.module, eval_batches)
        except Exception as err:  # noqa: BLE001
            row["status"] = f"held-out loss failed: {short_error(err)}"
    rate = run.rate()
    row.update(real_tok_s=rate, accum=run.accumulate, opt_steps=run.steps, padding=run.padding_ratio,
               microbatch_ms=run.microbatch_ms, step_ms=run.microbatch_ms * run.accumulate,
               mfu=rate * flops / peak if peak else None,
               peak_gib=run.peak_bytes / 2**30 if device.type == "cuda" else None,
               peak_mb_tokens=run.peak_tokens, held_out_loss=loss,
               masked_microbatches=run.masked_microbatches)  # fmt: skip
    if name == BOUND:
        row["attention_share"] = run.attention_seconds / run.timed["wall"] if run.timed["wall"] else None
        row["status"] += f" (attention: {run.backend})"
    return row


def print_training(result: dict[str, Any]) -> None:
    """The final table."""
    fmt = {"real_tok_s": "{:,.0f}", "x_padded": "{:.2f}x", "x_bound": "{:.2f}x", "padding": "{:.1%}",
           "microbatch_ms": "{:.1f}", "step_ms": "{:.0f}", "mfu": "{:.1%}", "peak_gib": "{:.2f}",
           "held_out_loss": "{:.4f}", "accum": "{}"}  # fmt: skip
    headers = ["mode", "accum", "real tok/s", "x padded", "x bound", "padding", "mb ms", "step ms", "MFU",
               "peak mb GiB", "held-out loss", "status"]  # fmt: skip
    keys = ["mode", "accum", "real_tok_s", "x_padded", "x_bound", "padding", "microbatch_ms", "step_ms", "mfu",
            "peak_gib", "held_out_loss", "status"]  # fmt: skip
    rows = [[fmt[k].format(r[k]) if k in fmt and r.get(k) is not None else str(r.get(k, "n/a") or "n/a")
             for k in keys] for r in result["rows"]]  # fmt: skip
    masked = sum(r.get("masked_microbatches") or 0 for r in result["rows"])
    print(f"\n## Training: {result['summary']}; padded and dynamic are maskless (microbatches that needed a mask: "
          f"{masked}); '{BOUND}': the same documents, no padding, no cross-document work\n")  # fmt: skip
    print(markdown_table(headers, rows))


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and data (a code-path check, seconds)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="weights and activations (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument("--preset", choices=sorted(REFERENCE_PRESETS), default=None, help="model size")
    parser.add_argument("--tokens", type=int, default=None, help="real tokens every mode trains on")
    parser.add_argument("--budget-s", dest="budget", type=float, default=None, help="seconds of training rounds")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak for MFU (default: by device)")
    parser.add_argument("--out", default=None, help="JSON results (default: $OUT/gpu.json when $OUT is set)")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--run-gpu-tests", action="store_true", help="then pytest -m gpu (the gpu-marked tests)")
    parser.add_argument("--gpu-tests-timeout", type=float, default=150.0)
    args = parser.parse_args(argv)
    for key, value in SIZES["tiny" if args.tiny else "gpu"].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.config = ReferenceConfig.preset(args.preset, vocab_size=args.vocab, max_seq_len=args.max_tokens)
    if args.out is None and os.environ.get("OUT"):
        args.out = str(Path(os.environ["OUT"]) / "gpu.json")
    return args


def main(argv: list[str] | None = None) -> None:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but no CUDA device is visible; use --device cpu --tiny for a code-path check")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if device.type == "cpu":
        torch.set_num_threads(1)  # a shared CPU: one thread avoids OpenMP contention
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    started = time.perf_counter()
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                              "commit": git_commit(), "backends": available_backends(device, dtype),
                              "preset": args.preset, "dtype": str(dtype)}  # fmt: skip
    print(f"# lit_seqpack GPU benchmark: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"backends {report['backends']}, commit {report['commit']}, {report['date']}")  # fmt: skip
    if not args.skip_attention:
        report["attention"] = attention_table(args, device, dtype)
    result = training(args, device, dtype)
    gc.collect()  # the modes' models are gone: hand their cached memory back before the tests' process
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report["training"] = result
    report["optional_imports"] = optional_imports()
    print(f"\noptional packages imported by lit_seqpack's model, data and planning modules: {optional_imports()}")
    if args.run_gpu_tests:
        report["gpu_tests"] = run_gpu_tests(ROOT, args.gpu_tests_timeout)
        print("\n## gpu-marked tests\n\n" + "\n".join(report["gpu_tests"]["tail"][-25:]))
    report["total_s"] = round(time.perf_counter() - started, 1)
    print(f"total {report['total_s']:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
        print(f"results written to {args.out}")
    print_training(result)


if __name__ == "__main__":
    main()
