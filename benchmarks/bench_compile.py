"""``torch.compile`` on packed rows: recompilations, graph breaks and step time, compiled vs eager.

Trains a transformers Llama (random init, prepared by :func:`lit_seqpack.model.hf.prepare_hf_model`) for
``--steps`` optimizer steps on packed rows of ``--tokens`` tokens whose document count changes every step (2 to
``--max-docs`` lognormal documents, fixed seed), once eagerly and once under ``torch.compile``, and prints a table:
graphs compiled, recompilations, graph breaks, the first step (compilation included) and the median step after
``--warmup`` steps. Compiled and eager losses are compared step by step.

Usage::

    python benchmarks/bench_compile.py                              # CPU, fp32, inductor, 50 steps
    python benchmarks/bench_compile.py --quick                      # 12 steps, compile backend "aot_eager"
    python benchmarks/bench_compile.py --device cuda --dtype bfloat16 --tokens 8192 --width 1024 --layers 8
    python benchmarks/bench_compile.py --quick --forward-only --attn-backend flex   # flex on CPU: forward only
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch._dynamo.utils import counters

from lit_seqpack.model.hf import hf_model_inputs, prepare_hf_model
from lit_seqpack.model.isolation import documents_batch


def packed_rows(steps: int, tokens: int, max_docs: int, vocab: int, device: str, seed: int = 0) -> list[dict]:
    """One packed batch per step: 2..max_docs lognormal documents filling ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(steps):
        count = int(rng.integers(2, max_docs + 1))
        weights = rng.lognormal(0.0, 1.0, count)
        lengths = np.maximum(2, np.floor(weights / weights.sum() * tokens)).astype(int)
        docs = [torch.from_numpy(rng.integers(1, vocab, n)).to(device) for n in lengths]
        rows.append(documents_batch(docs))
    return rows


def build_model(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.width * 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.width // 64),
        num_key_value_heads=max(1, args.width // 128),
        max_position_embeddings=args.tokens,
    )
    return prepare_hf_model(AutoModelForCausalLM.from_config(config)).to(args.device, getattr(torch, args.dtype))


def train(model: Any, rows: list[dict], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Per-step seconds and losses of ``--steps`` SGD steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, losses = [], []
    for batch in rows:
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.set_grad_enabled(not args.forward_only):
            logits = model(**hf_model_inputs(batch, backend=args.attn_backend)).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:], ignore_index=-100)
        if not args.forward_only:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per packed row")
    parser.add_argument("--max-docs", type=int, default=24)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attn-backend", default="auto", help="varlen_attention backend")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--quick", action="store_true", help="12 steps, compile backend aot_eager")
    parser.add_argument("--forward-only", action="store_true",
                        help="forward passes under no_grad, no optimizer (flex on CPU has no backward)")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.compile_backend = 12, 3, "aot_eager"
    rows = packed_rows(args.steps, args.tokens, args.max_docs, args.vocab, args.device)
    model = build_model(args)
    eager_times, eager_losses = train(copy.deepcopy(model), rows, args)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(copy.deepcopy(model), backend=args.compile_backend)
    compiled_times, compiled_losses = train(compiled, rows, args)
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = int(sum(counters["graph_break"].values()))
    docs = [int(b["num_documents"]) for b in rows]
    print(f"{args.steps} packed steps of {args.tokens} tokens, {min(docs)}-{max(docs)} documents per row "
          f"({len(set(docs))} distinct counts), Llama {args.layers}x{args.width}, {args.device} {args.dtype}, "
          f"attention {args.attn_backend}, torch.compile backend {args.compile_backend}"
          f"{', forward only' if args.forward_only else ''}")  # fmt: skip
    print(f"{'':10s} {'graphs':>7s} {'recompiles':>10s} {'breaks':>7s} {'first step s':>13s} {'median step ms':>15s}")
    for name, times, stats in (("eager", eager_times, ("-", "-", "-")),
                               ("compiled", compiled_times, (graphs, max(graphs - 1, 0), breaks))):  # fmt: skip
        median = statistics.median(times[args.warmup :]) * 1e3
        print(f"{name:10s} {stats[0]!s:>7s} {stats[1]!s:>10s} {stats[2]!s:>7s} {times[0]:13.2f} {median:15.1f}")
    diff = max(abs(a - b) for a, b in zip(eager_losses, compiled_losses, strict=True))
    print(f"largest |loss eager - loss compiled| over the steps: {diff:.2e}")


if __name__ == "__main__":
    main()
