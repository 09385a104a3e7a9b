"""Which transformers architectures train exactly in each mode: a table anyone can rerun (CPU, a minute).

For every architecture family a tiny randomly initialised model (2 layers, width 64, ``AutoConfig.for_model``,
dropout set to 0) is wrapped by ``HFCausalLM`` and compared with the **stock transformers model in eager
attention, run on each document alone**:

- packing: the isolation probe (``probe_packing_isolation``, train mode) decides exact or refused (its reason is
  printed); the max |logit| error of a packed row of 3 documents against the documents alone is printed in both
  cases (for a refused model it is the leak packing would have trained on);
- dynamic: the same documents right-padded to the longest (rounded to 8) in one ``[B, L]`` batch;
- padded: padded to a fixed 128 tokens.

An entry marked ``MISMATCH`` is a silent difference (no refusal, error above 1e-4): a bug to fix.

    python benchmarks/hf_matrix.py                       # every family below
    python benchmarks/hf_matrix.py --families llama,lfm2 # a few
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
import warnings
from typing import Any

import torch

from lit_seqpack.model.isolation import PackingLeakError, documents_batch, probe_packing_isolation

sys.path.insert(0, os.path.dirname(__file__))
from _common import markdown_table  # noqa: E402

COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
"""Sizes shared by the Llama-style configs; ``FAMILIES`` adds or renames per architecture."""

GPT2_STYLE = {"vocab_size": 128, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "gemma": {},
    "gemma2": {"sliding_window": 16},
    "gemma3_text": {"sliding_window": 16},
    "phi3": {"pad_token_id": 0},
    "olmo2": {},
    "olmo3": {"sliding_window": 16},
    "granite": {},
    "cohere": {},
    "starcoder2": {"sliding_window": 16},
    "stablelm": {},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 16},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "head_dim": 8,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "nemotron": {},
    "phi": {},
    "falcon": {},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },  # fmt: skip
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "smollm3": {"pad_token_id": 0},
    "glm": {"pad_token_id": 0},
    "helium": {},
    "arcee": {},
    "cohere2": {"sliding_window": 16},
    "exaone4": {"sliding_window": 16},
    "gpt2": dict(GPT2_STYLE),
    "gpt_neox": {"rotary_pct": 0.5},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "num_experts": 2},
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8},
    "qwen3_next": {
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_5_text": {
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
}
"""Per architecture: config keywords over ``COMMON`` (GPT-2 uses its own names; windows shorter than documents)."""

WITHOUT: dict[str, tuple[str, ...]] = {"falcon": ("head_dim",)}
"""``COMMON`` keys an architecture does not accept."""

LENGTHS = (37, 21, 12)
"""Documents of the packed row (longer than every window above)."""


def build(model_type: str, seed: int = 0) -> tuple[Any, Any]:
    """``(HFCausalLM, stock eager model)`` with the same weights, dropout set to 0."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_seqpack.model.lm import HFCausalLM

    common = {k: v for k, v in COMMON.items() if k not in WITHOUT.get(model_type, ())}
    settings = FAMILIES[model_type] if model_type == "gpt2" else {**common, **FAMILIES[model_type]}
    config = AutoConfig.for_model(model_type, **settings)
    zero = {k: 0.0 for k, v in config.to_dict().items() if "drop" in k and isinstance(v, float) and v > 0}
    torch.manual_seed(seed)
    module = HFCausalLM(config={"model_type": model_type, **settings}, config_overrides=zero, attn_backend="sdpa")
    stock_config = copy.deepcopy(module.model.config)  # from_config would switch the shared config to eager
    stock = AutoModelForCausalLM.from_config(stock_config, attn_implementation="eager")
    stock.load_state_dict(module.model.state_dict())
    return module, stock.eval()


def _per_document(stock: Any, docs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [stock(input_ids=doc[None]).logits[0].float() for doc in docs]


def _padded(docs: list[torch.Tensor], width: int) -> dict[str, Any]:
    batch = documents_batch(docs, packed=False)
    pad = width - batch["input_ids"].shape[1]
    for key in ("input_ids", "attention_mask", "labels"):
        batch[key] = torch.nn.functional.pad(batch[key], (0, pad), value=-100 if key == "labels" else 0)
    batch["position_ids"] = torch.arange(width).expand(len(docs), -1)
    return batch


def _error(logits: torch.Tensor, expected: list[torch.Tensor], starts: list[tuple[int, int, int]]) -> float:
    pairs = zip(starts, expected, strict=True)
    return max((logits[row, s:e].float() - ref).abs().max().item() for (row, s, e), ref in pairs)


def _short(err: BaseException) -> str:
    """One line for the reasons list: the layer of a leak, else the error's first sentence."""
    text = str(err)
    if isinstance(err, PackingLeakError):
        caller = re.search(r"its caller (\S+) \((\w+)\)", text)
        if caller:
            return f"{caller[2]} (`{caller[1]}`) drops `**kwargs`: attention never receives `cu_seq_lens`"
        layer = re.search(r"Cause: .*?(\S+) \((\w+)\)", text)
        if layer:
            return f"documents mix in {layer[2]} (`{layer[1]}`), which has no varlen kernel"
    interface = re.search(r"(\w+) cannot be trained with mode: packing: it does not dispatch attention", text)
    if interface:
        return f"{interface[1]} has no AttentionInterface: it keeps its own attention (dynamic, padded)"
    kernel = re.search(r"(\w+) cannot be trained with mode: packing here: its layers' (\S+) needs the '(\S+)'", text)
    if kernel:
        return f"{kernel[1]}: `{kernel[2]}` keeps packed documents apart only with `{kernel[3]}` (not installed)"
    return f"{type(err).__name__}: {text.split('; ')[0]}"[:160].replace("|", "/")


def measure(model_type: str) -> dict[str, str]:
    """The three cells of one architecture's row (and the reason of a refusal)."""
    module, stock = build(model_type)  # a model without AttentionInterface (Falcon) keeps its own attention:
    # HFCausalLM then refuses its packed rows, so its packing cell cannot read exact
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]
    row: dict[str, str] = {}
    with torch.no_grad():
        expected = _per_document(stock, docs)
    try:
        probe_packing_isolation(module.train(), documents_batch(docs))
        refusal = None
    except (PackingLeakError, ValueError) as err:
        refusal = _short(err)
    bounds = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    module.eval()
    with torch.no_grad():
        try:
            packed = module.seqpack_forward(documents_batch(docs))
            error = _error(packed, expected, [(0, bounds[i], bounds[i + 1]) for i in range(len(docs))])
            measured = f"{error:.1e}"
        except Exception as err:  # noqa: BLE001 - a refusal inside the forward is reported as such
            measured, refusal = "-", refusal or _short(err)
        failures: dict[str, list[str]] = {}
        if refusal:
            row["packing"] = f"refused (leak {measured})"
            failures.setdefault(refusal, []).append("packing")
        else:
            row["packing"] = f"exact {measured}" if float(measured) <= 1e-4 else f"MISMATCH {measured}"
        for mode, width in (("dynamic", -(-max(LENGTHS) // 8) * 8), ("padded", 128)):
            try:
                logits = module.seqpack_forward(_padded(docs, width))
                error = _error(logits, expected, [(i, 0, n) for i, n in enumerate(LENGTHS)])
                row[mode] = f"exact {error:.1e}" if error <= 1e-4 else f"MISMATCH {error:.1e}"
            except Exception as err:  # noqa: BLE001
                row[mode] = "error"
                failures.setdefault(_short(err), []).append(mode)
    if failures:
        row["reason"] = "; ".join(f"{'/'.join(modes)}: {text}" for text, modes in failures.items())
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model_types")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows, reasons = [], []
    for model_type in args.families.split(","):
        start = time.perf_counter()
        try:
            cells = measure(model_type)
        except Exception as err:  # noqa: BLE001 - an architecture that does not build is a row, not a crash
            cells = {"packing": "does not build", "dynamic": "-", "padded": "-", "reason": _short(err)}
        if "reason" in cells:
            reasons.append(f"- `{model_type}`: {cells['reason']}")
        seconds = f"{time.perf_counter() - start:.1f}"
        rows.append([model_type, cells["packing"], cells["dynamic"], cells["padded"], seconds])
    import transformers

    print(f"transformers {transformers.__version__}, torch {torch.__version__}; max |logit error| against the stock")
    print(f"eager model run on each document alone (documents of {list(LENGTHS)} tokens, fp32, CPU)\n")
    print(markdown_table(["model_type", "packing", "dynamic", "padded", "s"], rows))
    if reasons:
        print("\nRefused or failing:\n" + "\n".join(reasons))


if __name__ == "__main__":
    main()
