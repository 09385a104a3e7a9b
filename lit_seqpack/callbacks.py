"""Lightning callback that shows, live and at the end of fit, how much compute went to real tokens."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from typing_extensions import override

from lit_seqpack._checks import check_int
from lit_seqpack.metrics.counts import TokenKind, check_token_kind
from lit_seqpack.metrics.flops import FlopCount, device_peak_flops, document_lengths, flop_counter
from lit_seqpack.metrics.tracker import PackingTracker, RunTotals
from lit_seqpack.parallel import ParallelLayout
from lit_seqpack.parallel.layout import mesh_layout, strategy_mesh

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

__all__ = ["GradNormMonitor", "PackingMonitor"]

_PROG_BAR_KEYS = ("tokens_per_sec", "padding_ratio")


class _Stopwatch:
    """Seconds spent in a stage, with pauses; ``lap`` closes a window and opens the next at the same instant."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started: float | None = None
        self.banked = 0.0

    @property
    def running(self) -> bool:
        return self.started is not None

    def start(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def pause(self) -> None:
        if self.started is not None:
            self.banked += self.clock() - self.started
            self.started = None

    def lap(self) -> float:
        now = self.clock()
        elapsed = self.banked + (now - self.started if self.started is not None else 0.0)
        self.banked = 0.0
        if self.started is not None:
            self.started = now
        return elapsed

    def reset(self) -> None:
        self.started, self.banked = None, 0.0


def _is_replica(trainer: Trainer, batch: Any) -> bool:
    """Whether this rank's batch is a copy that tensor-parallel rank 0 of its group counts already.

    The tensor-parallel ranks of one data-parallel (and context-parallel) rank hold the same rows; summing their
    tokens over ranks would count every row ``tensor_parallel_size`` times. The rank is the device mesh's when the
    strategy has one, else lit_seqpack's layout (tensor-parallel innermost).
    """
    if not isinstance(batch, Mapping) or int(batch.get("tensor_parallel_size", 1)) == 1:
        return False
    mesh = strategy_mesh(trainer.strategy)
    if mesh is not None:
        return mesh_layout(mesh).tensor_parallel_rank != 0
    layout = ParallelLayout(
        context_parallel_size=int(batch.get("context_parallel_size", 1)),
        tensor_parallel_size=int(batch["tensor_parallel_size"]),
    )
    return layout.coordinates(trainer.global_rank).tensor_parallel_rank != 0


def _synchronize(device: torch.device) -> None:
    """Wait for queued device work, so that the host clock measures it (only on devices that queue work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _loss_line(loss_key: str, first: Sequence[float], last: Sequence[float], logged: int) -> str | None:
    """The summary's loss line: the mean of the first and of the last logged values, and how many they are.

    The two windows never share a value: a run that logged fewer than twice the window compares the first half of its
    values with the second half (one value: that value, said so), so a short run's change is never hidden.

    Args:
        loss_key: the loss's key.
        first: the first logged values (at most ``loss_window``).
        last: the last logged values (at most ``loss_window``).
        logged: how many values were logged in all.

    Example:
        >>> _loss_line("train/loss", [4.0, 3.0], [2.5, 1.5], logged=10)
        'train/loss         3.5000 -> 2.0000 (mean of the first and of the last 2 of 10 logged steps)'
        >>> _loss_line("train/loss", [4.0, 3.0, 2.0], [4.0, 3.0, 2.0], logged=3)
        'train/loss         4.0000 -> 2.0000 (the first and the last of 3 logged steps)'
        >>> _loss_line("train/loss", [4.0], [4.0], logged=1)
        'train/loss         4.0000 (1 logged step)'
        >>> _loss_line("train/loss", [], [], logged=0) is None
        True
    """
    if not first or not last:
        return None
    if logged == 1:
        return f"{loss_key:<18} {first[0]:.4f} (1 logged step)"
    size = min(len(first), len(last), logged // 2)  # disjoint windows
    head, tail = list(first)[:size], list(last)[-size:]
    mean_head, mean_tail = sum(head) / size, sum(tail) / size
    what = "the first and the last" if size == 1 else f"mean of the first and of the last {size}"
    return f"{loss_key:<18} {mean_head:.4f} -> {mean_tail:.4f} ({what} of {logged} logged steps)"


@rank_zero_only
def _log_summary(totals: RunTotals, loss: str | None) -> None:
    v = totals.values()
    lines = [
        "PackingMonitor summary (training, all ranks):",
        f"  real tokens        {totals.real_tokens:,}",
        f"  padding tokens     {totals.padding_tokens:,}",
        f"  padding ratio      {v['padding_ratio']:.2%}",
        f"  tokens/s           {v['tokens_per_sec']:,.1f} real, {v['computed_tokens_per_sec']:,.1f} computed "
        f"over {totals.elapsed:.2f} s",
        f"  packing efficiency {v['packing_efficiency']:.4f} (bin utilization {v['bin_utilization']:.4f}, "
        f"bin balance {v['bin_balance']:.4f})",
        f"  rank imbalance     {v['rank_imbalance']:.4f} mean, {v['rank_imbalance_max']:.4f} max",
    ]
    if loss is not None:
        lines.append(f"  {loss}")
    rank_zero_info("\n".join(lines))


class PackingMonitor(Callback):
    """Logs padding, throughput, packing and rank-balance metrics for training, validation and test.

    Every microbatch updates a :class:`~lit_seqpack.metrics.PackingTracker` from the batch's Python scalars
    (packed rows and padded ``[B, L]`` batches alike, so the padding ratios of the three modes compare
    directly). At each logging step of the Trainer (``log_every_n_steps``, after an optimizer step) the
    window since the previous log is reduced over ranks (tokens summed, elapsed time of the slowest rank)
    and logged under ``train/``: ``padding_ratio``, ``tokens_per_sec``, ``computed_tokens_per_sec``,
    ``packing_efficiency``, ``bin_utilization``, ``waste_ratio``, ``bin_balance``, ``rank_imbalance``,
    ``rank_imbalance_max`` (rates and ratios over the window) and ``real_tokens``, ``padding_tokens``
    (cumulative). Tokens/s and the padding ratio also go to the progress bar. Validation and test log the
    same keys under ``val/`` and ``test/`` once per epoch. At the end of fit rank 0 logs a summary of the
    whole run and, if the module logged ``loss_key``, its smoothed first and last values: the mean of the values
    logged at the first and at the last ``loss_window`` logging steps (one microbatch's loss is noise; a run of fewer
    than ``2 x loss_window`` logging steps compares its first half with its second half, never the same values).

    Why computed values and not Metric objects: Lightning logs a Metric object's per-step value from its
    rank-local ``forward`` cache, which is neither a window nor all ranks. The values logged here are
    already reduced over ranks by the metrics' own sync (``sum`` / ``max`` / ``cat``), so step values use
    ``sync_dist=False``; epoch values use ``sync_dist=True, reduce_fx="max"``, the identity on values every
    rank agrees on. (Logging each rank's own rate with ``sync_dist=True``, a mean, would average
    rates over ranks, which is wrong for a throughput.)

    Timing: the training clock starts at the first batch and pauses during validation; the device is
    synchronised (CUDA/MPS only) at each log step, around validation and at the end of an evaluation epoch,
    never in between, so the window's tokens/s includes data loading, optimizer and logging time.
    Stateful: a checkpoint saves the run totals of every optimizer step trained so far (also those since the last
    log step: saving is then a collective over the ranks, as Lightning's ``save_checkpoint`` already is) and the
    logged losses of the summary, so a resumed run ends with the totals of an uninterrupted one.

    Args:
        prog_bar: put ``train/tokens_per_sec`` and ``train/padding_ratio`` in the progress bar.
        summary: log the end-of-fit summary on rank 0.
        imbalance_tokens: which tokens the rank imbalance balances (``"real"`` or ``"computed"``).
        loss_key: the key under which the LightningModule logs its training loss.
        loss_window: logging steps averaged into the summary's first and last loss.
        clock: seconds of a monotonic clock (``time.perf_counter``); replace it to time deterministically.
        peak_flops: with it, also log ``train/tflops`` (useful model TFLOP/s over all ranks: the FLOPs of
            :func:`~lit_seqpack.metrics.flops.training_flops` over the window's real documents, over the slowest
            rank's time) and ``train/mfu`` (that over ``peak_flops x world_size``). A number is one device's peak
            in FLOP/s; ``"auto"`` reads a CUDA device's dense bf16 peak from
            :data:`~lit_seqpack.metrics.flops.PEAK_FLOPS`; ``None`` (default) logs neither.
    """

    def __init__(
        self,
        *,
        prog_bar: bool = True,
        summary: bool = True,
        imbalance_tokens: TokenKind = "real",
        loss_key: str = "train/loss",
        loss_window: int = 5,
        clock: Callable[[], float] = time.perf_counter,
        peak_flops: float | Literal["auto"] | None = None,
    ) -> None:
        if not callable(clock):
            raise ValueError(f"clock must be a callable returning seconds, got {clock!r}")
        if (
            peak_flops is not None
            and peak_flops != "auto"
            and (
                isinstance(peak_flops, bool)
                or not isinstance(peak_flops, int | float)
                or not math.isfinite(peak_flops)
                or peak_flops <= 0
            )
        ):
            raise ValueError(f"peak_flops must be 'auto', None or a device's peak FLOP/s > 0, got {peak_flops!r}")
        self.peak_flops = peak_flops
        self._flops = _FlopWindow()
        self.loss_window = check_int("loss_window", loss_window, minimum=1)
        self.prog_bar = prog_bar
        self.summary = summary
        self.imbalance_tokens = check_token_kind(imbalance_tokens)
        self.loss_key = loss_key
        self.trackers = {stage: PackingTracker(imbalance_tokens=imbalance_tokens) for stage in ("train", "val", "test")}
        self._watches = {stage: _Stopwatch(clock) for stage in self.trackers}
        self._device = torch.device("cpu")
        self._step_at_batch_start = 0
        self._paused_for_val = False
        self._losses = _LoggedLosses(self.loss_window)
        self.last_summary: dict[str, float] | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(loss_key=self.loss_key, imbalance_tokens=self.imbalance_tokens)

    def _flush(self, stage: str, trainer: Trainer | None = None) -> dict[str, float]:
        _synchronize(self._device)
        values = self.trackers[stage].flush(elapsed=self._watches[stage].lap())
        if stage == "train" and trainer is not None and self._flops.counting:
            values |= self._flops.flush(trainer, self.trackers[stage].last_window.elapsed)
        return values

    def _read_loss(self, trainer: Trainer) -> float | None:
        metrics = trainer.callback_metrics
        for key in (f"{self.loss_key}_step", self.loss_key):
            if key in metrics:
                return float(metrics[key])
        return None

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._device = trainer.strategy.root_device
        for tracker in self.trackers.values():
            tracker.to(self._device)
        if stage == "fit":
            self._flops = _FlopWindow(pl_module, self._resolve_peak(self._device)) if self.peak_flops else _FlopWindow()
            self.trackers["train"].reset()
            self._watches["train"].reset()
            self._losses = _LoggedLosses(self.loss_window)
            self._paused_for_val = False

    def _resolve_peak(self, device: torch.device) -> float:
        return device_peak_flops(device) if self.peak_flops == "auto" else float(self.peak_flops)  # type: ignore[arg-type]

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._flops.recount(pl_module)

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        self._watches["train"].start()

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        stepped = trainer.global_step != self._step_at_batch_start
        replica = _is_replica(trainer, batch)
        self.trackers["train"].update(batch, step_end=stepped, replica=replica)
        if not replica:
            self._flops.add(batch)
        # the same condition under which Lightning writes step metrics (LearningRateMonitor uses it too)
        logging_step = stepped and (trainer._logger_connector.should_update_logs or trainer.fast_dev_run)
        if not logging_step:
            return
        loss = self._read_loss(trainer)
        if loss is not None:
            self._losses.add(loss)
        values = self._flush("train", trainer)
        for key, value in values.items():
            pl_module.log(
                f"train/{key}",
                value,
                on_step=True,
                on_epoch=False,
                prog_bar=self.prog_bar and key in _PROG_BAR_KEYS,
                sync_dist=False,
                batch_size=1,
            )

    @override
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or not self._watches["train"].running:
            return
        _synchronize(self._device)  # the training work queued so far belongs to the training clock
        self._watches["train"].pause()
        self._paused_for_val = True

    @override
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._paused_for_val:
            _synchronize(self._device)
            self._watches["train"].start()
            self._paused_for_val = False

    def _eval_epoch_start(self, stage: str) -> None:
        self.trackers[stage].reset()
        self._watches[stage].reset()
        _synchronize(self._device)
        self._watches[stage].start()

    def _eval_epoch_end(self, stage: str, pl_module: LightningModule) -> None:
        values = self._flush(stage)
        self._watches[stage].reset()
        for key, value in values.items():
            pl_module.log(f"{stage}/{key}", value, on_step=False, on_epoch=True, sync_dist=True, reduce_fx="max")

    @override
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._eval_epoch_start("val")

    @override
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            self.trackers["val"].update(batch, step_end=True, replica=_is_replica(trainer, batch))

    @override
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._eval_epoch_end("val", pl_module)

    @override
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_epoch_start("test")

    @override
    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.trackers["test"].update(batch, step_end=True, replica=_is_replica(trainer, batch))

    @override
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_epoch_end("test", pl_module)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tracker = self.trackers["train"]
        tracker.end_step()
        self._flush("train", trainer)  # every rank calls it: the last window joins the totals
        self._watches["train"].reset()
        self.last_summary = tracker.totals.values()
        if self.summary:
            losses = self._losses
            _log_summary(tracker.totals, _loss_line(self.loss_key, losses.first, losses.last, losses.count))

    @override
    def state_dict(self) -> dict[str, Any]:
        """The run totals of every whole optimizer step so far and the logged losses (a collective over ranks)."""
        tracker = self.trackers["train"]
        _synchronize(self._device)
        tracker.add_elapsed(self._watches["train"].lap())  # the open window's time so far
        return {"totals": tracker.snapshot().state_dict(), "losses": self._losses.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.trackers["train"].totals = RunTotals.from_state_dict(state_dict["totals"])
        self._losses = _LoggedLosses.from_state_dict(self.loss_window, state_dict.get("losses"))


class _LoggedLosses:
    """The first and the last ``window`` values of the loss at logging steps, and how many were logged."""

    def __init__(self, window: int) -> None:
        self.first: list[float] = []
        self.last: deque[float] = deque(maxlen=window)
        self.count = 0

    def add(self, value: float) -> None:
        if len(self.first) < self.last.maxlen:
            self.first.append(value)
        self.last.append(value)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first), "last": list(self.last), "count": self.count}

    @classmethod
    def from_state_dict(cls, window: int, state: Mapping[str, Any] | None) -> _LoggedLosses:
        losses = cls(window)
        if state is not None:  # checkpoints of lit_seqpack <= 0.1 saved no losses
            losses.first = [float(v) for v in state["first"]][:window]
            losses.last.extend(float(v) for v in state["last"])
            losses.count = int(state["count"])
        return losses


class _FlopWindow:
    """The useful FLOPs of the microbatches since the last flush (no device sync until then).

    Each microbatch's document lengths stay on the device (:func:`~lit_seqpack.metrics.flops.document_lengths`)
    until :meth:`flush`, which runs after the monitor's synchronisation, reads them at once, counts them with
    :func:`~lit_seqpack.metrics.flops.training_flops` and sums the FLOPs over ranks. A context-parallel shard holds
    ``1 / context_parallel_size`` of its row's work.

    Args:
        module: the model whose FLOPs to count (``None``: count nothing).
        peak: one device's peak FLOP/s.
    """

    def __init__(self, module: LightningModule | None = None, peak: float = 0.0) -> None:
        self.peak = peak
        self.module = module
        self.count: Callable[[list[int]], int | float] | None = None
        self.pending: list[tuple[torch.Tensor, int]] = []
        if module is not None:
            self.recount(module)

    @property
    def counting(self) -> bool:
        return self.module is not None

    def recount(self, module: LightningModule) -> None:
        """Read the model's count (again: a model built in ``configure_model`` has its parameters only now)."""
        if self.module is None:
            return
        count = flop_counter(module)
        if not isinstance(count, FlopCount) or count.active_parameters > 0 or self.count is None:
            self.count = count

    def add(self, batch: Any) -> None:
        if self.module is not None and isinstance(batch, Mapping):
            self.pending.append((document_lengths(batch).detach(), int(batch.get("context_parallel_size", 1))))

    def flush(self, trainer: Trainer, elapsed: float) -> dict[str, float]:
        """``tflops`` and ``mfu`` of the window (a collective: every rank calls it at the same points)."""
        local = 0.0
        for lengths, shards in self.pending:
            local += self.count(lengths.tolist()) / shards  # type: ignore[misc]
        self.pending = []
        dtype = torch.float32 if trainer.strategy.root_device.type == "mps" else torch.float64
        total = trainer.strategy.reduce(
            torch.tensor(local, dtype=dtype, device=trainer.strategy.root_device), reduce_op="sum"
        )
        rate = float(total) / elapsed if elapsed > 0 else 0.0
        return {"tflops": rate / 1e12, "mfu": rate / (self.peak * trainer.world_size)}


class GradNormMonitor(Callback):
    """Logs the global gradient norm of every optimizer step as ``train/grad_norm`` (before clipping).

    Read in ``on_before_optimizer_step``: after Lightning unscaled mixed-precision gradients and after DDP averaged
    them, before ``gradient_clip_val`` clips them (a norm far above the clip value says the clip is doing the work).
    Logged at Lightning's logging steps (``log_every_n_steps``), like the loss. Under ``FSDPStrategy`` each rank holds
    a shard: the ranks' norms are combined (p-th powers summed), so the value is the whole model's; under
    ``ModelParallelStrategy`` (FSDP2, tensor parallel) each sharded gradient's norm is reduced over its device mesh
    (one collective a mesh), so it is the whole model's there too.

    Args:
        norm_type: the p of the p-norm (2.0: the Euclidean norm clipping uses by default).
        prog_bar: also show it in the progress bar.
    """

    def __init__(self, *, norm_type: float = 2.0, prog_bar: bool = False) -> None:
        if not norm_type > 0:
            raise ValueError(f"norm_type={norm_type!r} must be > 0")
        self.norm_type = float(norm_type)
        self.prog_bar = prog_bar

    @override
    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if not trainer._logger_connector.should_update_logs:
            return
        grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
        if not grads:
            return
        plain, by_mesh = [], {}
        for grad in grads:
            if hasattr(grad, "device_mesh"):  # a DTensor (FSDP2, tensor parallel): its norm reduces over its mesh
                by_mesh.setdefault(grad.device_mesh, []).append(grad)
            else:
                plain.append(grad)
        norms = [torch.linalg.vector_norm(g.float(), self.norm_type) for g in plain]
        for sharded in by_mesh.values():  # one collective a mesh: the whole parameters' norm, on every rank
            norms.append(self._norm([self._norm([g.float()]) for g in sharded]).full_tensor())
        norm = self._norm(norms)
        if "FSDP" in type(trainer.strategy).__name__ and trainer.world_size > 1:  # flat shards over every rank
            power = trainer.strategy.reduce(norm**self.norm_type, reduce_op="sum")
            norm = power ** (1.0 / self.norm_type)
        pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False, prog_bar=self.prog_bar)

    def _norm(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The p-norm of ``tensors`` together (a norm of their norms)."""
        if len(tensors) == 1:
            return torch.linalg.vector_norm(tensors[0], self.norm_type)
        return torch.linalg.vector_norm(torch.stack(tensors), self.norm_type)
