"""Packing vs padded for one tiny vision-language model: real tokens per second and padding, side by side.

A tiny random Qwen2-VL (the model of ``configs/vlm_sft.yaml``: 2 text layers of width 64, a 1-layer vision tower
with patch 8) trains one epoch of the embedded image set (``lit_seqpack/data/assets/vlm_demo``: 48 conversations with
0-2 PNGs) in each mode, through ``HFCausalLM.training_step`` with backward and an AdamW step per microbatch, on
the same data and weights. Real tokens count every conversation's tokens (its image tokens included), never padding;
the vision tower's patches are the same work in both modes. CPU timings: compare rows of one run only.

    python benchmarks/bench_vlm.py              # 3 epochs per mode
    python benchmarks/bench_vlm.py --epochs 1
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.dirname(__file__))
from _common import markdown_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASSETS = os.path.join(ROOT, "lit_seqpack", "data", "assets", "vlm_demo")
FIELDS = {"token_fields": {"mm_token_type_ids": 0}, "sample_fields": ["pixel_values", "image_grid_thw"]}


def _model_config() -> dict:
    with open(os.path.join(ROOT, "configs", "vlm_sft.yaml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)["model"]["init_args"]["config"]


def _run(mode: str, model, epochs: int) -> dict[str, float]:
    from lit_seqpack.data.datamodule import SeqPackDataModule
    from lit_seqpack.data.sources.chat import ChatSource

    source = ChatSource(os.path.join(ASSETS, "chat.jsonl"), os.path.join(ASSETS, "processor"))
    budget = {"max_tokens": 256} if mode == "packing" else {"batch_size": 8}
    dm = SeqPackDataModule(source=source, mode=mode, seed=0, sequence_length_round=8, **budget, **FIELDS)
    dm.setup("fit")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real = padding = batches = 0
    model.train()
    start = time.perf_counter()
    for _ in range(epochs):
        for batch in dm.train_dataloader():
            loss = model.training_step(batch, 0)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            real += batch["num_real_tokens"]
            padding += batch["num_padding_tokens"]
            batches += 1
    elapsed = time.perf_counter() - start
    return {"real": real, "padding": padding, "batches": batches, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from lit_seqpack.model.lm import HFCausalLM

    base = HFCausalLM(config=_model_config(), lr=1e-3)
    rows = []
    for mode in ("padded", "packing"):
        result = _run(mode, copy.deepcopy(base), args.epochs)
        total = result["real"] + result["padding"]
        rows.append(
            [
                mode,
                str(result["batches"]),
                str(result["real"]),
                f"{result['padding'] / total:.1%}",
                f"{result['real'] / result['seconds']:,.0f}",
            ]
        )
    print(f"tiny Qwen2-VL, {args.epochs} epochs of {ASSETS.removeprefix(ROOT + os.sep)} (CPU, 1 thread)")
    print(markdown_table(["mode", "microbatches", "real tokens", "padding", "real tokens/s"], rows))


if __name__ == "__main__":
    main()
