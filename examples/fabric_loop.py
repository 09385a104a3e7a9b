"""A Lightning Fabric training loop on packed rows, with gradient accumulation, exact over ranks and microbatches.

Outside a Trainer nothing tells the planner how many microbatches an optimizer step holds, so the loop declares it
once and both sides use it: ``SeqPackDataModule.attach_fabric`` plans every step's loss-token total for it, and
:class:`~lit_seqpack.model.mixin.FabricAccumulation` checks every batch against it, skips the gradient sync until
the last microbatch and divides by the accumulation, as Lightning's loop does. The update is then the gradient of
the token mean over every sample of the optimizer step, as with one big padded batch::

    python examples/fabric_loop.py                                   # 1 process, accumulation 2
    python examples/fabric_loop.py --devices 2                       # 2 CPU processes (DDP on gloo)
    python examples/fabric_loop.py --plan-accumulation 1             # a plan for another accumulation: ValueError

``--save-first-step PATH`` writes the first optimizer step's gradients (rank 0, after the all-reduce), the initial
weights and the step's samples, which ``tests/test_fabric_loop.py`` compares with one big padded batch.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from lightning.fabric import Fabric

from lit_seqpack import ReferenceLM, SeqPackDataModule
from lit_seqpack.data.sources import SyntheticInstructionDataset
from lit_seqpack.model.mixin import FabricAccumulation

TINY = {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=1, help="CPU processes (DDP on gloo when > 1)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=2, help="microbatches per optimizer step")
    parser.add_argument("--plan-accumulation", type=int, default=None, help="plan for another accumulation (demo)")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--max-tokens", type=int, default=256, help="token budget of a packed row")
    parser.add_argument("--num-samples", type=int, default=400, help="synthetic samples")
    parser.add_argument("--precision", default="32-true", help="Fabric precision (64-true for the exactness test)")
    parser.add_argument("--save-first-step", default=None, help="write the first step's gradients here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    fabric = Fabric(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision=args.precision,
    )
    fabric.launch()
    synthetic = {"num_samples": args.num_samples, "vocab_size": 64, "median_length": 24, "max_length": 128}
    data = SeqPackDataModule(
        source=SyntheticInstructionDataset(**synthetic), mode="packing", max_tokens=args.max_tokens, seed=1
    )
    accumulation = FabricAccumulation(fabric, accumulate_grad_batches=args.accumulate_grad_batches)
    planned = accumulation.accumulate_grad_batches if args.plan_accumulation is None else args.plan_accumulation
    data.attach_fabric(fabric, accumulate_grad_batches=planned)  # the plan's steps are the loop's steps
    data.setup("fit")

    torch.manual_seed(0)  # the same initial weights on every rank
    lm = ReferenceLM(vocab_size=data.vocab_size, **TINY, lr=3e-3, lr_schedule="constant", attn_backend="sdpa")
    initial = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    optimizer = lm.configure_optimizers()["optimizer"]  # AdamW, weight decay on the >= 2-D weights only
    model, optimizer = fabric.setup(lm, optimizer)
    train_loader = data.train_dataloader()
    loader = fabric.setup_dataloaders(train_loader, use_distributed_sampler=False)

    steps, tokens, share, losses, start, epoch = 0, 0, 0.0, [], time.perf_counter(), 0
    while steps < args.max_steps:
        train_loader.batch_sampler.set_epoch(epoch)  # no Trainer calls set_epoch here: reshuffle each epoch
        for batch in loader:
            loss = model.training_step(batch, steps)  # the mixin's exact loss (normalised over the whole step)
            tokens += batch["num_real_tokens"]
            share += float(loss.detach()) / (batch["world_size"] * batch["accumulate_grad_batches"])
            if not accumulation.backward(model, loss, batch):
                continue
            if steps == 0 and args.save_first_step:
                _save_first_step(fabric, lm, data, train_loader.batch_sampler.plan, initial, args.save_first_step)
            optimizer.step()
            optimizer.zero_grad()
            # this rank's share of the step's token-mean loss; summed over ranks it is the step's loss
            losses.append(float(fabric.all_reduce(torch.tensor(share, dtype=torch.float64), reduce_op="sum")))
            steps, share = steps + 1, 0.0
            if steps >= args.max_steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    summed = fabric.all_reduce(torch.tensor(tokens), reduce_op="sum")  # referenced until the process group is gone
    total = int(summed)
    fabric.print(
        f"fabric: {steps} steps x {args.accumulate_grad_batches} microbatches x {fabric.world_size} ranks in "
        f"{elapsed:.1f} s, {total / elapsed:,.0f} real tokens/s, loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # End the process group here, not at exit. gloo's worker threads free each finished collective, which takes
        # the GIL when it frees a tensor Python has let go of, while destroying the group joins those threads with
        # the GIL held: the two at once deadlock (torch 2.13), and at exit the threads die joinable (SIGABRT). So the
        # DDP model goes first (its reducer holds the group, which would die with it when main returns), and the last
        # collective's tensor is still referenced when destroy_process_group joins the threads.
        fabric.barrier()
        del model, optimizer, loader
        gc.collect()
        torch.distributed.destroy_process_group()
    del summed
    return {"steps": steps, "elapsed": elapsed, "first_loss": losses[0], "last_loss": losses[-1]}


def _save_first_step(fabric: Fabric, model: ReferenceLM, data: SeqPackDataModule, plan, initial, path: str) -> None:
    """Rank 0 writes the averaged gradients, the initial weights, the hyperparameters and the step's samples."""
    if fabric.global_rank != 0:
        return
    view = data.splits["train"][0]
    samples = [view[i] for rank in plan.step_microbatches(0) for micro in rank for i in micro]  # every rank's
    samples = [{k: [int(t) for t in s[k]] for k in ("input_ids", "labels")} for s in samples]
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    torch.save({"grads": grads, "initial": initial, "hparams": dict(model.hparams), "samples": samples}, path)


if __name__ == "__main__":
    main()
