"""The benchmarks' training loop: one mode's model, optimizer and loader, stepped by hand on the library's path.

``benchmarks/`` is ``sys.path[0]`` when a benchmark runs as a script, so they ``import _train_loop``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from lit_seqpack.batch import is_right_padded


class ModeRun:
    """One mode's training state: its module, AdamW, training loader and counters.

    A microbatch goes the library's way: the loader's next batch (planned by a lit_seqpack batch sampler for
    ``accumulate`` microbatches per optimizer step, collated into the batch contract), the mixin's
    ``training_step`` (the exact loss, scaled by ``accumulate / step_loss_tokens``), divided by ``accumulate``
    and back-propagated as Lightning's automatic optimisation does, then the module's own AdamW every
    ``accumulate`` microbatches. So the update of a step is the gradient of the token mean over its samples.

    Forward + backward (+ the optimizer on a step's last microbatch) is timed, in wall-clock seconds and in CPU
    seconds of this process (``time.process_time``: on a shared machine the CPU time is what the work cost, the
    wall time also holds the waits for a core). After the clock stops, each padded microbatch is checked for right
    padding (the models then attend with no mask): ``masked_microbatches`` counts those that needed a mask. On CUDA
    the device is synchronised around it and the peak memory
    above its start (activations, gradients, optimizer temporaries) is recorded. The first ``warmup`` microbatches
    (allocator and kernel warm-up, the mixin's one-time isolation probe) are not timed.

    Args:
        name: the mode's label.
        module: a ``PackedSequenceMixin`` LightningModule on ``device`` (``configure_optimizers`` works without a
            Trainer when its schedule is constant).
        loader: an iterable of batches whose ``batch_sampler.sampler`` has ``set_epoch`` (lit_seqpack's samplers).
        accumulate: microbatches per optimizer step (the plan's ``accumulate_grad_batches``).
        device: where the batches go.
        autocast: run forward and loss under ``torch.autocast`` with this dtype (``None``: no autocast).
        warmup: untimed first microbatches.
    """

    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        loader: Any,
        *,
        accumulate: int = 1,
        device: torch.device | str = "cpu",
        autocast: torch.dtype | None = None,
        warmup: int = 1,
    ) -> None:
        self.name, self.module, self.loader, self.warmup = name, module, loader, warmup
        self.accumulate, self.device, self.autocast = accumulate, torch.device(device), autocast
        self._epoch, self._batches = 0, iter(loader)
        config = module.configure_optimizers()
        self.optimizer, self.scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        self.microbatches = self.steps = self.real_tokens = self.computed_tokens = 0
        self.timed = {"microbatches": 0, "real": 0, "wall": 0.0, "cpu": 0.0}
        self.peak_tokens = self.peak_attn = self.peak_bytes = 0
        self.padded_microbatches = self.masked_microbatches = 0  # masked: not right-padded, so attention needs a mask

    def _next_batch(self) -> dict[str, Any]:
        try:
            batch = next(self._batches)
        except StopIteration:
            self._epoch += 1
            self.loader.batch_sampler.sampler.set_epoch(self._epoch)
            self._batches = iter(self.loader)
            batch = next(self._batches)
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}

    def microbatch(self) -> None:
        """Forward and backward of one microbatch; the optimizer steps after the step's last one."""
        batch = self._next_batch()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            start_bytes = torch.cuda.memory_allocated(self.device)
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss = self.module.training_step(batch, self.microbatches)
        (loss / self.accumulate).backward()
        if (self.microbatches + 1) % self.accumulate == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.steps += 1
        if cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated(self.device) - start_bytes)
        self._count(batch, time.perf_counter() - wall, time.process_time() - cpu)

    def _count(self, batch: dict[str, Any], wall: float, cpu: float) -> None:
        real, computed = batch["num_real_tokens"], batch["input_ids"].numel()
        self.microbatches += 1
        self.real_tokens += real
        self.computed_tokens += computed
        if self.microbatches > self.warmup:
            for key, value in (("microbatches", 1), ("real", real), ("wall", wall), ("cpu", cpu)):
                self.timed[key] += value
        self.peak_tokens = max(self.peak_tokens, computed)
        self.peak_attn = max(self.peak_attn, attention_elements(batch))
        mask = batch.get("attention_mask")
        if mask is not None:
            self.padded_microbatches += 1
            self.masked_microbatches += not is_right_padded(mask)

    def train_until(self, real_tokens: int) -> None:
        """Train whole optimizer steps until at least ``real_tokens`` real tokens were seen."""
        while self.real_tokens < real_tokens or self.microbatches % self.accumulate:
            self.microbatch()

    def rate(self, clock: str = "wall") -> float:
        """Real tokens per second of the timed microbatches, by the ``"wall"`` or the ``"cpu"`` clock."""
        return self.timed["real"] / self.timed[clock] if self.timed[clock] else 0.0

    @property
    def padding_ratio(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0

    @property
    def microbatch_ms(self) -> float:
        """Mean wall-clock milliseconds of a timed microbatch."""
        return 1e3 * self.timed["wall"] / self.timed["microbatches"] if self.timed["microbatches"] else 0.0


def attention_elements(batch: dict[str, Any]) -> int:
    """Attention-score elements per head and layer: ``sum of L^2`` over a packed row's segments, ``B x L^2`` padded."""
    if batch.get("cu_seqlens") is not None:
        return int((batch["cu_seqlens"].diff().long() ** 2).sum())
    rows, length = batch["input_ids"].shape
    return rows * length * length


def datamodule_loader(dataset: Any, spec: dict[str, Any], *, accumulate: int = 1) -> Any:
    """The training loader of a ``SeqPackDataModule(source=dataset, **spec)``, planned for one rank and ``accumulate``.

    The DataModule reads world size, rank and accumulation from its Trainer: it gets a real, never fitted
    ``Trainer(accumulate_grad_batches=accumulate)`` on one CPU device.
    """
    from lightning.pytorch import Trainer

    from lit_seqpack.data.datamodule import SeqPackDataModule

    datamodule = SeqPackDataModule(source=dataset, **spec)
    quiet = logging.getLogger("lightning.pytorch")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # "GPU available: False ..." lines
    try:
        datamodule.trainer = Trainer(
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=accumulate,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    finally:
        quiet.setLevel(level)
    datamodule.setup("fit")
    return datamodule.train_dataloader()


def held_out_batches(dataset: Any, max_tokens: int) -> list[dict[str, Any]]:
    """The evaluation samples as packed rows (no shuffle): the same inputs for every mode's model."""
    return list(datamodule_loader(dataset, {"mode": "packing", "max_tokens": max_tokens, "shuffle": False}))


def held_out_loss(module: torch.nn.Module, batches: Sequence[dict[str, Any]]) -> float:
    """Token-mean loss over ``batches`` through the mixin's forward and loss hooks (eval mode, no grad)."""
    module.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            output = module.seqpack_loss(module.seqpack_forward(batch), batch)
            total += float(output.loss_sum)
            count += output.num_units
    module.train()
    return total / max(count, 1)


def profile_steps(runs: dict[str, ModeRun], names: Sequence[str], microbatches: int = 4, rows: int = 12) -> None:
    """Print torch.profiler's top operators (self CPU time) over further microbatches of each named mode."""
    from torch.profiler import ProfilerActivity, profile

    for name in names:
        if name not in runs:
            continue
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(microbatches):
                runs[name].microbatch()
        print(f"\ntorch.profiler, {name}, {microbatches} microbatches (forward + backward + AdamW + loader):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
