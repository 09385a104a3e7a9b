"""Varlen attention backends against a dense block-diagonal mask and against padding; packed vs padded model.

Part 1 times forward + backward of causal attention over one packed row of ``--tokens`` tokens split into 16 and
256 documents (lognormal lengths, fixed seed), 8 heads x 64, for:

* every backend :func:`lit_seqpack.available_backends` lists for the device (``sdpa`` per document on CPU);
* ``dense mask``: one SDPA call over the whole row with a ``[T, T]`` block-diagonal causal mask;
* ``padded``: SDPA over the same documents padded on the right to ``[docs, max_len]``, causal with no mask
  (``is_causal``: exact for every real token, what the reference decoder runs for right-padded batches);
* ``padded + mask``: the same with a dense causal + key-padding mask (what left padding needs).

Part 2 times forward + backward of the reference decoder (``--preset``, default ``demo``: 4 layers, width 128,
vocab 512) on the same samples collated packed (one row, varlen attention with the ``auto`` backend) and padded
(``[docs, max_len]``, right padding: no mask), and reports real tokens per second.

Usage::

    python benchmarks/bench_attention.py            # CPU, fp32, 5 repeats
    python benchmarks/bench_attention.py --quick    # 2 repeats, smaller model batch
    python benchmarks/bench_attention.py --device cuda --dtype bfloat16 --preset 100m
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.model.attention import available_backends, varlen_attention
from lit_seqpack.model.reference import REFERENCE_PRESETS, ReferenceConfig, ReferenceDecoder


def doc_lengths(num_docs: int, total: int, seed: int = 0) -> list[int]:
    """``num_docs`` lognormal-ish lengths (each >= 1) that sum to ``total``."""
    weights = np.random.default_rng(seed).lognormal(mean=0.0, sigma=1.0, size=num_docs)
    lengths = np.maximum(1, np.floor(weights / weights.sum() * total)).astype(int)
    lengths[np.argmax(lengths)] += total - lengths.sum()
    return lengths.tolist()


def median_times(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each closure; the closures take turns in every round, so load drift hits them alike."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def attention_cases(lengths: list[int], heads: int, head_dim: int, device: torch.device, dtype: torch.dtype):
    """Name -> a closure running forward + backward of one attention layout over the same documents."""
    total, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    cases = {}
    for backend in available_backends(device, dtype):
        if backend == "flex" and device.type == "cpu":  # FlexAttention has no backward on CPU (refused by name)
            continue
        cases[f"varlen {backend}"] = lambda b=backend: (
            varlen_attention(q, k, v, cu, longest, backend=b).sum().backward()
        )

    segment = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    dense_mask = (segment[:, None] == segment[None, :]).tril()

    def dense() -> None:
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=dense_mask)
        out.sum().backward()

    shape = (len(lengths), heads, longest, head_dim)
    qp, kp, vp = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    idx = torch.arange(longest, device=device)
    real = idx[None, :] < torch.tensor(lengths, device=device)[:, None]
    pad_mask = ((idx[:, None] >= idx[None, :]) & real[:, None, :]) | (idx[:, None] == idx[None, :])

    def padded() -> None:
        F.scaled_dot_product_attention(qp, kp, vp, is_causal=True).sum().backward()

    def padded_mask() -> None:
        F.scaled_dot_product_attention(qp, kp, vp, attn_mask=pad_mask[:, None]).sum().backward()

    return cases | {"dense mask": dense, "padded": padded, "padded + mask": padded_mask}


def bench_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    doc_counts = (16, 256)
    results: dict[str, dict[int, float]] = {}
    for num_docs in doc_counts:
        lengths = doc_lengths(num_docs, args.tokens, seed=args.seed)
        cases = attention_cases(lengths, args.heads, args.head_dim, device, dtype)
        for name, seconds in median_times(cases, args.repeats, device).items():
            results.setdefault(name, {})[num_docs] = seconds
    print(f"\nAttention fwd+bwd, {args.tokens} tokens, {args.heads} heads x {args.head_dim}, {dtype}, {device.type}, "
          f"median of {args.repeats}")  # fmt: skip
    header = "".join(f" | {n:>3} docs ms | x dense | x padded" for n in doc_counts)
    print(f"{'method':<20}{header}")
    print("-" * (20 + len(header)))
    for name, times in results.items():
        cells = [
            f" | {times[n] * 1e3:11.1f} | {results['dense mask'][n] / times[n]:7.2f} | "
            f"{results['padded'][n] / times[n]:8.2f}"
            for n in doc_counts
        ]
        print(f"{name:<20}{''.join(cells)}")


def bench_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(args.seed)
    config = ReferenceConfig.preset(args.preset, max_seq_len=args.model_tokens)
    model = ReferenceDecoder(config).to(device=device, dtype=dtype)
    lengths = doc_lengths(args.model_docs, args.model_tokens, seed=args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    samples = [{"input_ids": torch.randint(1, config.vocab_size, (n,), generator=gen)} for n in lengths]
    layouts = {"packed": PackedCollator()(samples), "padded": PaddedCollator()(samples)}
    print(f"\nReference decoder ({args.preset} preset, {config.num_parameters() / 1e6:.2f}M parameters) fwd+bwd, "
          f"{len(samples)} documents, {sum(lengths)} real tokens (longest {max(lengths)}), "
          f"median of {args.repeats}")  # fmt: skip
    print(f"{'layout':<8} | {'shape':>11} | {'padding':>7} | {'ms':>8} | {'real tok/s':>10} | x padded")
    steps = {}
    for name, batch in layouts.items():
        inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        kwargs = {"position_ids": inputs["position_ids"]}
        if name == "packed":
            kwargs |= {"cu_seqlens": inputs["cu_seqlens"], "max_seqlen": inputs["max_seqlen"]}
        else:
            kwargs["attention_mask"] = inputs["attention_mask"]

        def step(ids: torch.Tensor = inputs["input_ids"], kw: dict = kwargs) -> None:
            model.zero_grad(set_to_none=True)
            model(ids, **kw).float().logsumexp(-1).mean().backward()

        steps[name] = step
    seconds_of = median_times(steps, args.repeats, device)
    for name, batch in layouts.items():
        seconds = seconds_of[name]
        shape = "x".join(str(s) for s in batch["input_ids"].shape)
        padding = batch["num_padding_tokens"] / batch["input_ids"].numel()
        speedup = seconds_of["padded"] / seconds
        print(f"{name:<8} | {shape:>11} | {padding:7.1%} | {seconds * 1e3:8.1f} | "
              f"{batch['num_real_tokens'] / seconds:10.0f} | {speedup:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 repeats and a smaller model batch")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the attention row")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5, 2 with --quick)")
    parser.add_argument("--model-docs", type=int, default=None, help="documents in the model batch (default 64)")
    parser.add_argument("--model-tokens", type=int, default=None, help="real tokens in the model batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument("--preset", default="demo", choices=sorted(REFERENCE_PRESETS), help="reference model size")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.model_docs = args.model_docs or (32 if args.quick else 64)
    args.model_tokens = args.model_tokens or (2048 if args.quick else 4096)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, backends: {available_backends(device)}")
    bench_attention(args, device, dtype)
    if not args.skip_model:
        bench_model(args, device, dtype)


if __name__ == "__main__":
    main()
