"""Train a transformers model packed: a tiny randomly initialised Llama through ``HFCausalLM``.

``HFCausalLM`` switches the model's attention to lit_seqpack's varlen function and passes ``cu_seq_lens_q/k``,
``position_ids`` and ``use_cache=False``, so documents packed in one row never see each other (a stock
``LlamaForCausalLM`` given packed ``position_ids`` alone attends across them). This script first proves it on a
real packed row (every document's logits equal its logits run alone), then trains a few steps::

    python examples/hf_model.py                       # 100 steps on the embedded synthetic task
    python examples/hf_model.py --max-steps 5 --num-samples 300       # a smoke run

For a pretrained model: ``HFCausalLM(model_name_or_path="/path/to/local/checkpoint")``.
"""

from __future__ import annotations

import argparse
import time

import torch
from lightning.pytorch import Trainer

from lit_seqpack import PackingMonitor, SeqPackDataModule, check_packing_equivalence
from lit_seqpack.data.sources import SyntheticInstructionDataset
from lit_seqpack.model.lm import HFCausalLM


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--max-tokens", type=int, default=1024, help="packed row length")
    parser.add_argument("--num-samples", type=int, default=5000, help="synthetic samples")
    parser.add_argument("--hidden-size", type=int, default=64, help="Llama width")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    return parser.parse_args(argv)


def llama_config(vocab_size: int, hidden_size: int, max_tokens: int) -> dict:
    """Keyword arguments of a tiny ``LlamaConfig`` (randomly initialised, nothing downloaded)."""
    return {
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 3 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": max_tokens,
        "tie_word_embeddings": True,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    synthetic = {"num_samples": args.num_samples, "vocab_size": 64, "median_length": 64, "sigma": 0.6,
                 "max_length": min(512, args.max_tokens), "tasks": ["sort", "copy"]}  # fmt: skip
    data = SeqPackDataModule(
        source=SyntheticInstructionDataset(**synthetic),
        mode="packing",
        max_tokens=args.max_tokens,
        sequence_length_round=8,
    )
    model = HFCausalLM(config=llama_config(data.vocab_size, args.hidden_size, args.max_tokens), lr=3e-3)

    # the first row with several documents (the first step runs the costliest row, often one long document)
    row = next(batch for batch in data.train_dataloader() if int(batch["num_documents"]) > 1)
    report = check_packing_equivalence(model, row, atol=1e-4, strict=True)
    print(
        f"isolation: {row['num_documents']} documents packed in a row of {row['input_ids'].shape[1]} tokens, "
        f"logits equal each document run alone up to {report.max_error:.2e}"
    )

    monitor = PackingMonitor()  # logs a summary at the end: padding, tokens/s, first -> last loss
    trainer = Trainer(
        accelerator="cpu",
        max_steps=args.max_steps,
        use_distributed_sampler=False,  # the DataModule's samplers already plan every rank
        callbacks=[monitor],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=max(1, min(10, args.max_steps)),
    )
    start = time.perf_counter()
    trainer.fit(model, data)
    totals = monitor.last_summary
    loss = float(trainer.callback_metrics["train/loss"])
    print(
        f"HF Llama packed: {trainer.global_step} steps in {time.perf_counter() - start:.1f} s, padding ratio "
        f"{totals['padding_ratio']:.2%}, {totals['tokens_per_sec']:,.0f} real tokens/s, last train/loss {loss:.3f}"
    )
    return {"loss": loss, "isolation_error": report.max_error, **totals}


if __name__ == "__main__":
    main()
