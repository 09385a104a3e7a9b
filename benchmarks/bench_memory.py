"""Peak memory of one training step: the loss from the full logits vs the chunked loss from hidden states.

One packed row (default 8,192 tokens in documents of 256-2,048 tokens) through a tiny model with a large vocabulary
(default 65,536): the plain path holds ``[tokens, vocab]`` float32 logits, their log-softmax and their gradient; the
chunked path (``chunked_loss=True``, the default of ``ReferenceLM`` and ``HFCausalLM``) holds one chunk's. Both
variants run the module's real ``training_step`` path (``seqpack_step`` + backward) from the same weights.

Method: every variant runs in a fresh subprocess, one after the other (no allocator or cache state shared). The
child builds the model and the batch, runs the one-off probes (packing isolation, the chunked head's check), then
reads its resident set (``VmRSS``), resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``), runs
one step (forward, loss, backward: the parameters' gradients included) and reads the high-water mark ``VmHWM``:
the peak increase is ``VmHWM - VmRSS before``. Where ``clear_refs`` is not writable it falls back to
``getrusage(RUSAGE_SELF).ru_maxrss`` minus the resident set before (an overestimate only if the process peaked
higher before the step; the table says which method ran). The children save their loss and gradients; the parent
compares them (loss to 1e-5 relative, every gradient to 1e-4 of its largest entry).

    python benchmarks/bench_memory.py                        # HF Llama and ReferenceLM, 8,192 tokens, vocab 65,536
    python benchmarks/bench_memory.py --chunks 1024 4096     # more chunk sizes, side by side
    python benchmarks/bench_memory.py --tokens 256 --vocab 1024 --chunks 64   # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

GOAL = 0.35
"""The chunked path's peak increase must be at most this fraction of the plain path's."""


def _model(kind: str, vocab: int, tokens: int, chunked: bool, chunk: int) -> torch.nn.Module:
    from lit_seqpack.model.lm import HFCausalLM, ReferenceLM

    torch.manual_seed(0)
    if kind == "reference":
        sizes = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "intermediate_size": 128}
        return ReferenceLM(vocab_size=vocab, max_seq_len=tokens, chunked_loss=chunked, loss_chunk_size=chunk, **sizes)
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": tokens,
    }
    return HFCausalLM(config=config, chunked_loss=chunked, loss_chunk_size=chunk)


def _batch(vocab: int, tokens: int) -> dict:
    """One packed row of ``tokens`` tokens: documents of 256-2,048 tokens (the last one takes the rest)."""
    gen = torch.Generator().manual_seed(1)
    lengths, left = [], tokens
    while left > 0:
        length = min(left, int(torch.randint(max(tokens // 32, 2), max(tokens // 4, 3) + 1, (1,), generator=gen)))
        lengths.append(length)
        left -= length
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    loss_tokens = int((labels != -100).sum())
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seqlens": cu,
        "max_seqlen": max(lengths),
        "num_loss_tokens": loss_tokens,
        "step_loss_tokens": loss_tokens,
    }


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def child(args: argparse.Namespace) -> None:
    """One variant in this process: print its peak increase, save its loss and gradients."""
    chunked = args.variant != "plain"
    module = _model(args.model, args.vocab, args.tokens, chunked, args.variant_chunk)
    module.train()
    batch = _batch(args.vocab, args.tokens)
    module.seqpack_verify_packing(batch)  # the one-off probes run before the measurement
    head = module.seqpack_output_head()
    if chunked and head is None:
        raise SystemExit(f"{args.model}: the chunked loss fell back to the full logits")
    try:
        Path("/proc/self/clear_refs").write_text("5")
        method = "VmHWM (clear_refs)"
    except OSError:
        method = "ru_maxrss"
    before = _kib("VmRSS")
    start = time.perf_counter()
    loss = module.seqpack_step(batch, "train")
    loss.backward()
    seconds = time.perf_counter() - start
    peak = _kib("VmHWM") if method.startswith("VmHWM") else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    grads = {name: p.grad for name, p in module.named_parameters()}
    torch.save({"loss": float(loss.detach()), "grads": grads}, args.out)
    print(json.dumps({"increase_mib": (peak - before) / 1024, "seconds": seconds, "method": method}))


def _run_child(model: str, variant: str, chunk: int, args: argparse.Namespace, out: Path) -> dict:
    command = [
        sys.executable, __file__, "--child", "--model", model, "--variant", variant, "--variant-chunk", str(chunk),
        "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{model} {variant} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1]) | torch.load(out)


def _grad_error(got: dict, expected: dict) -> float:
    worst = 0.0
    for name, grad in expected.items():
        scale = float(grad.abs().max()) or 1.0
        worst = max(worst, float((got[name] - grad).abs().max()) / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["hf", "reference"], choices=["hf", "reference"])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the packed row")
    parser.add_argument("--vocab", type=int, default=65536, help="vocabulary size")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024], help="chunk sizes of the chunked loss")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    parser.add_argument("--variant-chunk", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"one packed row of {args.tokens:,} tokens, vocabulary {args.vocab:,} (float32 logits alone: "
          f"{logits_mib:,.0f} MiB); torch {torch.__version__}, {os.cpu_count()} CPUs")  # fmt: skip
    print()
    print("| model | loss path | peak increase (MiB) | x plain | loss | loss rel. diff | max grad diff | step s "
          "| method |")  # fmt: skip
    print("|:--|:--|--:|--:|--:|--:|--:|--:|:--|")
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            name = {"hf": "HF Llama (HFCausalLM)", "reference": "ReferenceLM"}[model]
            plain = _run_child(model, "plain", args.chunks[0], args, Path(tmp) / f"{model}-plain.pt")
            rows = [("full logits", plain)]
            for chunk in args.chunks:
                rows.append((f"chunked {chunk}", _run_child(model, "chunked", chunk, args, Path(tmp) / f"{model}.pt")))
            for label, row in rows:
                ratio = row["increase_mib"] / plain["increase_mib"]
                loss_diff = abs(row["loss"] - plain["loss"]) / abs(plain["loss"])
                grad_diff = _grad_error(row["grads"], plain["grads"])
                print(f"| {name} | {label} | {row['increase_mib']:,.0f} | {ratio:.2f}x | {row['loss']:.6f} | "
                      f"{loss_diff:.1e} | {grad_diff:.1e} | {row['seconds']:.1f} | {row['method']} |")  # fmt: skip
                if label != "full logits":
                    exact = loss_diff <= 1e-5 and grad_diff <= 1e-4
                    verdicts.append(f"{name} {label}: {ratio:.2f}x the plain peak increase (goal <= {GOAL}x: "
                                    f"{'met' if ratio <= GOAL else 'missed'}); loss and gradients "
                                    f"{'exact' if exact else 'DIFFER'} (1e-5 / 1e-4)")  # fmt: skip
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
