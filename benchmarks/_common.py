"""Helpers shared by the training benchmarks: length profiles, the fair padded batch size, models, tables.

``benchmarks/`` is ``sys.path[0]`` when a benchmark runs as a script, so they ``import _common``.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset
from lit_seqpack.planning.plan import PlanConfig, build_plan

PROFILES: dict[str, dict[str, Any]] = {
    "lognormal": {"length_distribution": "lognormal", "sigma": 1.0},
    "power_law": {"length_distribution": "power_law", "alpha": 1.5},
}
"""Length profiles of the embedded synthetic task (median and clip come from the benchmark's size)."""

HF_TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
}
"""A transformers Llama with the ``demo`` reference preset's sizes (vocab and context set per run)."""


def profile_dataset(
    profile: str,
    *,
    num_samples: int,
    vocab_size: int,
    median_length: int,
    max_length: int,
    seed: int,
    tasks: Sequence[str] = ("sort",),
) -> SyntheticInstructionDataset:
    """The synthetic instruction task with one of :data:`PROFILES`' length distributions.

    The default task is ``sort``: the one a small model learns within a CPU benchmark's budget (the others copy
    or map tokens by position, which takes induction heads and millions of tokens), so loss curves move. The task
    does not change the lengths (they are drawn from their own hash stream), hence no throughput figure.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {profile!r}")
    return SyntheticInstructionDataset(
        num_samples=num_samples,
        vocab_size=vocab_size,
        median_length=median_length,
        max_length=max_length,
        seed=seed,
        tasks=tuple(tasks),
        **PROFILES[profile],
    )


def fair_batch_size(lengths: np.ndarray, max_tokens: int, *, seed: int, round_to: int = 1) -> tuple[int, float]:
    """The padded baseline's batch size under the same memory budget as the token-budget modes.

    The largest ``batch_size`` whose padded microbatches (``batch_size x longest``, the longest rounded up to
    ``round_to``) hold on average at most ``max_tokens`` tokens over one epoch's plan; returns it with that mean.
    """
    best = (1, _mean_padded_tokens(lengths, 1, seed, round_to))
    for batch_size in range(2, len(lengths) + 1):
        mean = _mean_padded_tokens(lengths, batch_size, seed, round_to)
        if mean > max_tokens:
            break
        best = (batch_size, mean)
    return best


def _mean_padded_tokens(lengths: np.ndarray, batch_size: int, seed: int, round_to: int) -> float:
    config = PlanConfig(mode="padded", batch_size=batch_size, seed=seed, sequence_length_round=round_to)
    stats = build_plan(lengths, config, epoch=0).stats
    return stats.computed_tokens / stats.num_microbatches


def build_module(
    kind: str,
    *,
    preset: str,
    vocab_size: int,
    max_seq_len: int,
    lr: float,
    warmup_steps: int = 0,
    attn_backend: str = "auto",
) -> torch.nn.Module:
    """A ``ReferenceLM`` (``kind="reference"``, sizes of ``preset``) or an ``HFCausalLM`` tiny Llama (``"hf"``).

    Linear warmup over ``warmup_steps`` optimizer steps, then a constant learning rate (no decay: the run's
    length in steps is not known to the module without a Trainer).
    """
    from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
    from lit_seqpack.model.reference import REFERENCE_PRESETS

    optim = {"lr": lr, "lr_schedule": "constant", "warmup_steps": warmup_steps, "attn_backend": attn_backend}
    if kind == "reference":
        sizes = REFERENCE_PRESETS[preset] | {"vocab_size": vocab_size}
        return ReferenceLM(**sizes, max_seq_len=max_seq_len, **optim)
    if kind == "hf":
        config = HF_TINY_LLAMA | {"vocab_size": vocab_size, "max_position_embeddings": max_seq_len}
        if preset == "tiny":
            config |= {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
        return HFCausalLM(config=config, **optim)
    raise ValueError(f"model must be 'reference' or 'hf', got {kind!r}")


def num_parameters(module: torch.nn.Module) -> int:
    """Distinct trainable parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters() if p.requires_grad}.values())


def machine_summary() -> str:
    """One line: CPU, cores, torch version and threads, load average (the machine may be shared)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), "
        f"load average {load_average()}"
    )


def load_average() -> str:
    """The 1/5/15-minute load averages, or ``n/a``."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table sized to its content: the first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def cells(values: Sequence[str]) -> str:
        return " | ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths, strict=True))
        )

    rule = "|:" + "-" * widths[0] + "-|" + "|".join("-" * (w + 1) + ":" for w in widths[1:]) + "|"
    body = [f"| {cells(r)} |" for r in rows]
    line = f"| {cells(headers)} |"
    return "\n".join([line, rule, *body])


def human(count: float) -> str:
    """``1234567 -> '1.23M'``, ``12345 -> '12.3k'``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(count) >= scale:
            return f"{count / scale:.3g}{unit}"
    return f"{count:.0f}"


def real_tokens_per_microbatch(lengths: np.ndarray, spec: dict[str, Any], *, seed: int, round_to: int = 1) -> float:
    """Mean real tokens of a microbatch in one epoch's plan of ``spec`` (DataModule keywords), one rank."""
    config = PlanConfig(
        mode=spec["mode"],
        max_tokens=spec.get("max_tokens"),
        algorithm=spec.get("algorithm"),
        batch_size=spec.get("batch_size"),
        sequence_length_round=round_to,
        seed=seed,
    )
    stats = build_plan(lengths, config, epoch=0).stats
    return stats.real_tokens / stats.num_microbatches


def matched_accumulation(per_microbatch: dict[str, float], reference: str) -> dict[str, int]:
    """Accumulation per mode so every optimizer step holds about as many real tokens as ``reference``'s steps.

    Example:
        >>> matched_accumulation({"padded": 700.0, "packing": 2000.0}, "packing")
        {'padded': 3, 'packing': 1}
    """
    target = per_microbatch[reference]
    return {name: max(1, round(target / value)) for name, value in per_microbatch.items()}
