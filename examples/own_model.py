"""Train your own ``nn.Module`` on packed rows: add ``PackedSequenceMixin`` to a LightningModule, that's all.

The mixin supplies ``training_step`` / ``validation_step`` with the exact token-mean loss; your ``forward`` only
has to keep attention inside each document of a packed row. Here a small decoder uses
:func:`lit_seqpack.varlen_attention` with ``cu_seqlens`` for packed rows and plain causal SDPA with the padding
mask for dynamic (padded ``[B, L]``) batches, and positions restart at every document (``position_ids``)::

    python examples/own_model.py                      # packing, 150 steps on the embedded synthetic task
    python examples/own_model.py --mode dynamic       # the same model on dynamic batches
    python examples/own_model.py --max-steps 5 --num-samples 300    # a smoke run

On its first packed batch the mixin checks that the model does not attend across documents (a forward that
ignored ``cu_seqlens`` would raise ``PackingLeakError`` instead of training silently wrong).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lit_seqpack import PackedSequenceMixin, PackingMonitor, SeqPackDataModule, varlen_attention
from lit_seqpack.data.sources import SyntheticInstructionDataset


class Block(nn.Module):
    """Pre-norm attention + MLP block; attention stays within documents (packed) or rows (padded)."""

    def __init__(self, width: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attention(self, x: torch.Tensor, cu_seqlens, max_seqlen, attention_mask) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head).unbind(2)
        if cu_seqlens is not None:  # one packed row: [T, heads, head_dim] per document boundaries
            out = varlen_attention(q[0], k[0], v[0], cu_seqlens, max_seqlen, causal=True)[None]
        else:  # padded rows: causal attention that never looks at padding keys
            causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
            mask = causal if attention_mask is None else causal & attention_mask[:, None, None, :].bool()
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
            out = out.transpose(1, 2)
        return self.out(out.reshape(batch, length, width))

    def forward(self, x: torch.Tensor, cu_seqlens=None, max_seqlen=None, attention_mask=None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cu_seqlens, max_seqlen, attention_mask)
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    """Token + learned position embeddings (indexed by ``position_ids``, which restart per document), blocks, head."""

    def __init__(self, vocab_size: int, width: int, n_head: int, n_layer: int, max_len: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab_size, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, n_head) for _ in range(n_layer))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids, position_ids, cu_seqlens=None, max_seqlen=None, attention_mask=None) -> torch.Tensor:
        x = self.embed(input_ids) + self.position(position_ids)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen, attention_mask)
        return self.head(self.norm(x))


class OwnLM(PackedSequenceMixin, LightningModule):
    """Your LightningModule: keyword-only ``__init__``, ``forward``, ``configure_optimizers``; the mixin trains it."""

    def __init__(self, *, vocab_size: int, width: int = 64, n_head: int = 4, n_layer: int = 2, max_len: int = 1024,
                 lr: float = 3e-3) -> None:  # fmt: skip
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyDecoder(vocab_size, width, n_head, n_layer, max_len)

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, attention_mask=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.model(input_ids, position_ids, cu_seqlens, max_seqlen, attention_mask)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("packing", "dynamic"), default="packing", help="batching mode")
    parser.add_argument("--max-steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--max-tokens", type=int, default=1024, help="token budget of a microbatch")
    parser.add_argument("--num-samples", type=int, default=5000, help="synthetic samples")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on a busy machine)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    synthetic = {"num_samples": args.num_samples, "vocab_size": 64, "median_length": 64, "sigma": 0.6,
                 "max_length": min(512, args.max_tokens), "tasks": ["sort", "copy"]}  # fmt: skip
    data = SeqPackDataModule(
        source=SyntheticInstructionDataset(**synthetic),
        mode=args.mode,
        max_tokens=args.max_tokens,
        sequence_length_round=8,
    )
    model = OwnLM(vocab_size=data.vocab_size, max_len=args.max_tokens)
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
        f"{args.mode}: {trainer.global_step} steps in {time.perf_counter() - start:.1f} s, "
        f"padding ratio {totals['padding_ratio']:.2%}, {totals['tokens_per_sec']:,.0f} real tokens/s, "
        f"last train/loss {loss:.3f}"
    )
    return {"loss": loss, **totals}


if __name__ == "__main__":
    main()
