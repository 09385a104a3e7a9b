"""``PackedSequenceMixin``: train, validate and test a causal LM on packed or dynamic batches, with an exact loss.

Mix it in front of ``LightningModule``; it implements ``training_step``, ``validation_step``, ``test_step`` and
``predict_step`` (per-sample log-probabilities, :mod:`lit_seqpack.prediction`)
for the batch contract of :mod:`lit_seqpack.batch` and owns no state, so ``__init__``,
``save_hyperparameters`` and LightningCLI introspection stay the user's::

    class MyLM(PackedSequenceMixin, LightningModule):
        def __init__(self, *, vocab_size: int = 32000) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.model = MyDecoder(vocab_size)

        def forward(self, input_ids, position_ids=None, cu_seqlens=None, max_seqlen=None, attention_mask=None):
            return self.model(input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                              attention_mask=attention_mask)

A packed row goes to ``forward`` with ``cu_seqlens`` / ``max_seqlen`` / ``position_ids`` (never an attention mask),
a padded ``[B, L]`` batch with ``attention_mask`` / ``position_ids``. Three hooks change that:
``seqpack_model_inputs(batch)`` (the keyword arguments), ``seqpack_forward(batch)`` (the logits) and
``seqpack_loss(logits, batch)`` (a :class:`~lit_seqpack.model.loss.LossOutput`).

**Chunked loss.** A module whose ``seqpack_output_head()`` returns an
:class:`~lit_seqpack.model.chunked_loss.OutputHead` (``ReferenceLM`` and ``HFCausalLM`` by default) is trained and
validated from its last hidden states (``seqpack_hidden_states(batch)``) through
:func:`~lit_seqpack.model.chunked_loss.chunked_cross_entropy`: the same loss and normalisation, but the
``[tokens, vocab]`` logits never exist at once. ``forward`` still returns the full logits.

**Exact loss.** The value returned for backward is ``loss_sum * world_size * accumulate_grad_batches /
step_loss_tokens`` where ``step_loss_tokens`` counts the targets of the whole optimizer step over all ranks (the
plan knows it; the collator puts it in the batch). Lightning divides by ``accumulate_grad_batches`` and DDP
averages over ranks, so the update is the gradient of the token mean over the step, as with one big padded batch.
The batch's ``world_size`` and ``accumulate_grad_batches`` must therefore be the trainer's: every training step
checks it and raises ``ValueError`` otherwise (a mismatch would silently scale the gradient).

**Vocabulary.** Every batch on the CPU, and the first :data:`VOCAB_CHECKED_BATCHES` batches per module on an
accelerator (one ``max`` of ``input_ids`` and of the labels, read in one device sync), are checked against the
model's ``vocab_size`` (when it exposes one): an id past the embedding raises a ``ValueError`` naming the id, the
vocabulary and the setting to change, instead of ``IndexError: index out of range in self`` deep in the
embedding or ``Target 100 is out of bounds`` in the loss. ``SeqPackDataModule`` checks every sample at setup
already; this is the boundary check for any other loader. Override ``seqpack_check_vocab`` to change it.

**Isolation.** The first packed batch a module sees per process and per train/eval mode triggers a structural
probe (:func:`~lit_seqpack.model.isolation.probe_packing_isolation`): the gradient of each document's logits with
respect to the other documents' input embeddings must be exactly zero; a model that mixes documents (attention
without the boundaries, a convolution or state-space layer) raises
:class:`~lit_seqpack.model.isolation.PackingLeakError`, naming the layer, instead of training silently wrong.

**Logging.** ``train/loss`` is the microbatch's token mean (unscaled) logged with ``batch_size=num_loss_tokens``;
``val/loss`` and ``test/loss`` are logged per epoch with ``batch_size=num_loss_tokens`` and ``sync_dist=True``,
so the epoch value is the token-weighted mean over all batches and ranks. Zero-weight dummy batches (lock-step
fillers) return ``0 * logits.sum()`` so every parameter still gets a (zero) gradient under DDP.

**Context parallelism.** A batch sharded by :func:`~lit_seqpack.data.batching.context_parallel.shard_packed_batch` (as
``SeqPackDataModule(context_parallel_size=...)`` delivers) is run inside
:func:`~lit_seqpack.model.cp_attention.context_parallel_scope`, so the model's ``varlen_attention`` calls become
context parallel; the default loss reads the shard's ``shift_labels`` (targets computed on the whole row), and the
exact loss sums the CP ranks' gradients (see :func:`~lit_seqpack.model.loss.exact_loss`). The trainer's world size
must be ``world_size x context_parallel_size x tensor_parallel_size`` of the batch.

Exact gradient accumulation in a Lightning Fabric loop: the accumulation is declared once and checked.

A Trainer knows ``accumulate_grad_batches`` and the mixin checks every batch against it. A Fabric loop has no such
setting, so the plan (``SeqPackDataModule.attach_fabric`` or a batch sampler's ``accumulate_grad_batches``) and the
loop could disagree silently: a plan made for accumulation 1 and a loop accumulating 2 microbatches gives a
relative gradient error of ~0.35. :class:`FabricAccumulation` is the loop's side::

    accumulation = FabricAccumulation(fabric, accumulate_grad_batches=2)
    datamodule.attach_fabric(fabric, accumulate_grad_batches=accumulation.accumulate_grad_batches)
    for batch in loader:
        loss = model.training_step(batch, 0)             # exact: normalised over the plan's optimizer step
        if accumulation.backward(model, loss, batch):    # checks the batch's plan, skips the sync until the step
            optimizer.step()
            optimizer.zero_grad()

``backward`` divides by the accumulation (as Lightning's loop does), so with the mixin's exact loss the update is
the gradient of the token mean over every microbatch of the optimizer step and every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lit_seqpack._checks import check_int
from lit_seqpack.batch import is_packed_batch
from lit_seqpack.model.chunked_loss import OutputHead, chunked_cross_entropy
from lit_seqpack.model.cp_attention import context_parallel_scope
from lit_seqpack.model.hf_load import model_vocab_size
from lit_seqpack.model.loss import LossOutput, exact_loss, token_cross_entropy
from lit_seqpack.parallel.layout import mesh_layout, strategy_mesh

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

__all__ = [
    "VOCAB_CHECKED_BATCHES",
    "PackedSequenceMixin",
    "check_batch_layout",
    "is_packed_batch",
    "FabricAccumulation",
]


_STAGE_PREFIX = {"train": "train", "validate": "val", "test": "test"}
_VERIFIED: weakref.WeakKeyDictionary[torch.nn.Module, set[bool]] = weakref.WeakKeyDictionary()
_VOCAB_CHECKS: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()

VOCAB_CHECKED_BATCHES = 8
"""Batches per module whose ids are checked against the vocabulary on an accelerator (every batch on a CPU)."""


class PackedSequenceMixin:
    """Training, validation and test steps for packed and dynamic batches with an exact token-mean loss.

    Use it as the first base: ``class MyLM(PackedSequenceMixin, LightningModule)``. See the module docstring for
    what it routes, how it normalises the loss and what it logs.

    Example, a sequence-mean loss (every document weighs the same, whatever its length)::

        from lit_seqpack.model.loss import sequence_cross_entropy

        class SequenceMeanLM(PackedSequenceMixin, LightningModule):
            def seqpack_loss(self, logits, batch):
                # step_documents=None: the mean over this microbatch's documents, then averaged by Lightning
                # (accumulation) and DDP; pass the step's document count over all ranks to make it exact.
                return sequence_cross_entropy(
                    logits, batch["labels"], cu_seqlens=batch.get("cu_seqlens"),
                    num_documents=batch.get("num_documents"), step_documents=None,
                )
    """

    # ----------------------------------------------------------------------------------------------- hooks
    def seqpack_model_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments of ``self(...)`` for ``batch``.

        Packed rows give ``input_ids``, ``position_ids``, ``cu_seqlens`` and ``max_seqlen``; padded batches give
        ``input_ids``, ``attention_mask`` and ``position_ids``. Override to rename or add arguments.
        """
        if is_packed_batch(batch):
            keys = ("input_ids", "position_ids", "cu_seqlens", "max_seqlen")
        else:
            keys = ("input_ids", "attention_mask", "position_ids")
        return {key: batch[key] for key in keys if key in batch}

    def seqpack_forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The logits ``[B, T, V]`` of ``batch``: ``self(**self.seqpack_model_inputs(batch))``.

        An output with a ``logits`` attribute (a transformers ``ModelOutput``) is unwrapped.
        """
        output = self(**self.seqpack_model_inputs(batch))  # type: ignore[operator]
        return getattr(output, "logits", output)

    def seqpack_loss(self, logits: torch.Tensor, batch: Mapping[str, Any]) -> LossOutput:
        """The microbatch's loss: by default the summed next-token cross-entropy, normalised over the step.

        Override to change the loss; return a :class:`~lit_seqpack.model.loss.LossOutput` whose ``step_units``
        is the unit count of the whole optimizer step over all ranks (exact) or ``None`` (local mean).
        """
        shifted = batch.get("shift_labels") is not None  # a context-parallel shard: targets come pre-shifted
        if batch.get("loss_weights") is not None:  # a weighted loss: the units are loss-weight sums
            return token_cross_entropy(
                logits,
                batch["shift_labels"] if shifted else batch["labels"],
                num_loss_tokens=batch.get("num_loss_weight"),
                step_loss_tokens=batch.get("step_loss_weight"),
                shifted=shifted,
                weights=batch["shift_loss_weights"] if shifted else batch["loss_weights"],
            )
        return token_cross_entropy(
            logits,
            batch["shift_labels"] if shifted else batch["labels"],
            num_loss_tokens=batch.get("num_loss_tokens"),
            step_loss_tokens=batch.get("step_loss_tokens"),
            shifted=shifted,
        )

    def seqpack_output_head(self) -> OutputHead | None:
        """The output projection for a loss computed from hidden states in chunks, or ``None`` (the default): the
        loss takes the full logits of ``seqpack_forward``. A module returning a head implements
        :meth:`seqpack_hidden_states`."""
        return None

    def seqpack_hidden_states(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """The last hidden states ``[B, T, H]`` of ``batch`` (what ``seqpack_output_head()`` projects to logits)."""
        raise NotImplementedError(f"{type(self).__name__} returns an output head but has no seqpack_hidden_states")

    def seqpack_chunked_loss(self, hidden: torch.Tensor, head: OutputHead, batch: Mapping[str, Any]) -> LossOutput:
        """:meth:`seqpack_loss` from hidden states: the same targets, weights and step units, chunk by chunk."""
        shifted = batch.get("shift_labels") is not None
        labels = batch["shift_labels"] if shifted else batch["labels"]
        if batch.get("loss_weights") is not None:
            return chunked_cross_entropy(
                hidden,
                head,
                labels,
                num_loss_tokens=batch.get("num_loss_weight"),
                step_loss_tokens=batch.get("step_loss_weight"),
                shifted=shifted,
                weights=batch["shift_loss_weights"] if shifted else batch["loss_weights"],
            )
        return chunked_cross_entropy(
            hidden,
            head,
            labels,
            num_loss_tokens=batch.get("num_loss_tokens"),
            step_loss_tokens=batch.get("step_loss_tokens"),
            shifted=shifted,
        )

    def seqpack_check_vocab(self, batch: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` when an id of ``batch`` (inputs or targets) is outside the model's vocabulary.

        Costs one ``max`` per tensor and one read of the two values: on every CPU batch, and on the first
        :data:`VOCAB_CHECKED_BATCHES` batches on an accelerator (no device sync after those).
        """
        vocab = model_vocab_size(self)
        ids = batch.get("input_ids")
        if vocab is None or not isinstance(ids, torch.Tensor) or ids.numel() == 0:
            return
        if ids.device.type != "cpu":
            seen = _VOCAB_CHECKS.get(self, 0)  # type: ignore[call-overload]
            if seen >= VOCAB_CHECKED_BATCHES:
                return
            _VOCAB_CHECKS[self] = seen + 1  # type: ignore[index]
        targets = batch.get("shift_labels") if batch.get("shift_labels") is not None else batch.get("labels")
        tops = [ids.max()] + ([targets.max()] if isinstance(targets, torch.Tensor) and targets.numel() else [])
        for key, top in zip(("input_ids", "labels"), torch.stack(tops).tolist(), strict=False):
            if top >= vocab:
                raise ValueError(
                    f"the batch's {key} holds id {int(top)} but {type(self).__name__} has vocab_size={vocab}: it "
                    "would index past the embedding (or the loss's classes). Raise the model's vocab_size (for "
                    "ReferenceLM: model.init_args.vocab_size; for HFCausalLM: model.init_args.config.vocab_size) "
                    f"to at least {int(top) + 1}, or fix the data (padding writes data.pad_token_id)"
                )

    def seqpack_verify_packing(self, batch: Mapping[str, Any]) -> None:
        """Raise :class:`~lit_seqpack.model.isolation.PackingLeakError` if the model mixes documents of a row.

        Runs once per module, process and mode (train, eval), on the first packed batch: three documents drawn
        from the batch's tokens are packed in one row, in the module's mode and the active precision, and the
        gradient of each one's logits on the others' embeddings must be exactly zero
        (:func:`~lit_seqpack.model.isolation.probe_packing_isolation`). Override with ``pass`` to skip it.
        """
        modes = _VERIFIED.setdefault(self, set())  # type: ignore[arg-type]
        training = bool(self.training)  # type: ignore[attr-defined]
        if training in modes:
            return
        from lit_seqpack.model.isolation import probe_packing_isolation

        probe_packing_isolation(self, batch)
        modes.add(training)

    # ----------------------------------------------------------------------------------------------- steps
    def seqpack_step(self, batch: Mapping[str, Any], stage: str) -> torch.Tensor:
        """Forward, loss and logging of one batch in ``stage`` (``"train"``, ``"validate"`` or ``"test"``).

        Returns the value to back-propagate in training (exactly normalised) and the microbatch mean otherwise.
        """
        if stage not in _STAGE_PREFIX:
            raise ValueError(f"stage must be one of {tuple(_STAGE_PREFIX)}, got {stage!r}")
        self.seqpack_check_vocab(batch)
        if is_packed_batch(batch):
            self.seqpack_verify_packing(batch)
        head = self.seqpack_output_head()
        with context_parallel_scope(batch):  # a no-op unless the batch is a context-parallel shard
            if head is None:
                logits = self.seqpack_forward(batch)
            else:
                hidden = self.seqpack_hidden_states(batch)
        output = self.seqpack_loss(logits, batch) if head is None else self.seqpack_chunked_loss(hidden, head, batch)
        if batch.get("is_empty", False):
            if stage != "train":  # weight 0: no effect on the epoch mean, same logged keys on every rank
                self._seqpack_log(stage, output.loss_sum.detach() * 0.0, 0)
            return (logits.sum() if head is None else output.loss_sum) * 0.0  # a zero reaching every parameter
        if stage == "train":
            if output.step_units is not None:
                _check_step_layout(batch, self._seqpack_trainer(), getattr(self, "_fabric", None))
            loss = exact_loss(output, batch)
        else:
            loss = output.loss_sum / (output.num_units or 1)  # a weight sum may be below 1
        if output.num_units > 0 or stage != "train":  # eval logs sync over ranks: every rank logs every batch
            self._seqpack_log(stage, output.loss_sum.detach() / (output.num_units or 1), output.num_units)
        return loss

    def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
        """The exactly normalised loss of one microbatch (see the module docstring)."""
        return self.seqpack_step(batch, "train")

    def validation_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Logs ``val/loss`` (token-weighted over the epoch); returns the microbatch's token mean."""
        return self.seqpack_step(batch, "validate")

    def test_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        """Logs ``test/loss`` (token-weighted over the epoch); returns the microbatch's token mean."""
        return self.seqpack_step(batch, "test")

    def predict_step(self, batch: Mapping[str, Any], batch_idx: int, dataloader_idx: int = 0) -> list[Any]:
        """One :class:`~lit_seqpack.prediction.SamplePrediction` per document of the batch (none for a filler).

        ``index`` (the sample's index in the predict source), ``token_logprobs`` (``log p(token t | tokens < t)``,
        ``t = 1 .. L - 1``), ``nll`` and ``num_loss_tokens`` (over the label positions), computed by
        :func:`~lit_seqpack.prediction.sample_predictions` from :meth:`seqpack_forward`'s logits. The first packed
        batch runs the isolation probe as in evaluation (predict runs under ``inference_mode``; the probe takes its
        gradients outside it). Sort with :func:`~lit_seqpack.prediction.predictions_in_order`, or write every rank's
        with :class:`~lit_seqpack.prediction.PredictionWriter`.
        """
        from lit_seqpack.prediction import sample_predictions

        if batch.get("is_empty", False):
            return []
        self.seqpack_check_vocab(batch)
        if is_packed_batch(batch):
            self.seqpack_verify_packing(batch)
        return sample_predictions(self.seqpack_forward(batch), batch)

    # ----------------------------------------------------------------------------------------------- private
    def _seqpack_trainer(self) -> Trainer | None:
        return getattr(self, "_trainer", None)

    def _seqpack_log(self, stage: str, value: torch.Tensor, batch_size: int | float) -> None:
        if getattr(self, "_fabric", None) is None and getattr(self, "_current_fx_name", None) is None:
            return  # a step called by hand, outside the Trainer's loops: nothing to log to
        name = f"{_STAGE_PREFIX[stage]}/loss"
        if stage == "train":
            self.log(name, value, batch_size=batch_size, prog_bar=True)  # type: ignore[attr-defined]
        else:
            self.log(  # type: ignore[attr-defined]
                name, value, batch_size=batch_size, on_step=False, on_epoch=True, sync_dist=True, prog_bar=True
            )


def _check_step_layout(batch: Mapping[str, Any], trainer: Trainer | None, fabric: Any = None) -> None:
    """Fail when the batch was planned for another layout or accumulation than the trainer (or Fabric) runs.

    The data-parallel size is the strategy's device mesh's when it has one (``ModelParallelStrategy``), since
    ``trainer.world_size`` counts tensor-parallel ranks too. Under Fabric only the world size is checked here (the
    accumulation is the loop's: :class:`~lit_seqpack.model.mixin.FabricAccumulation` checks it).
    """
    owner = trainer if trainer is not None else fabric
    if owner is None:
        return
    accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else None
    strategy = getattr(owner, "strategy", None)
    if accumulate is not None and accumulate > 1 and getattr(strategy, "handles_gradient_accumulation", False):
        raise ValueError(
            f"accumulate_grad_batches={accumulate} under {type(strategy).__name__}, which accumulates gradients "
            "itself (DeepSpeed divides the loss by gradient_accumulation_steps in its backward, on top of "
            "Lightning's division): the exact loss is not verified there. Use accumulate_grad_batches=1 with a "
            "larger max_tokens, or DDP / FSDP"
        )
    check_batch_layout(batch, world_size=int(owner.world_size), accumulate_grad_batches=accumulate, strategy=strategy)


def check_batch_layout(
    batch: Mapping[str, Any], *, world_size: int, accumulate_grad_batches: int | None, strategy: Any = None
) -> None:
    """Raise ``ValueError`` unless ``batch`` was planned for this world size, accumulation and device mesh.

    Args:
        batch: a training batch of the lit_seqpack contract (its ``world_size`` counts data-parallel ranks).
        world_size: every process of the run (data x context x tensor parallel).
        accumulate_grad_batches: microbatches per rank per optimizer step (``None``: not checked).
        strategy: the strategy, whose ``device_mesh`` (if any) gives the data-parallel size.
    """
    cp, tp = int(batch.get("context_parallel_size", 1)), int(batch.get("tensor_parallel_size", 1))
    dp, planned_accumulate = int(batch.get("world_size", 1)), int(batch.get("accumulate_grad_batches", 1))
    mesh = strategy_mesh(strategy)
    if mesh is not None:
        layout = mesh_layout(mesh)
        if (dp, cp, tp) != (layout.data_parallel_size, layout.context_parallel_size, layout.tensor_parallel_size):
            raise ValueError(
                f"the batch was planned for data x context x tensor parallel = {dp} x {cp} x {tp} ranks but the "
                f"strategy's device mesh is {layout.data_parallel_size} x {layout.context_parallel_size} x "
                f"{layout.tensor_parallel_size}; the exact loss would scale the "
                "gradient by the wrong factor. Give SeqPackDataModule the mesh's tensor_parallel_size and "
                "context_parallel_size (its data-parallel size is read from the mesh)"
            )
    planned_world = dp * cp * tp
    actual_accumulate = planned_accumulate if accumulate_grad_batches is None else accumulate_grad_batches
    if (planned_world, planned_accumulate) != (world_size, actual_accumulate):
        raise ValueError(
            f"the batch was planned for world_size={planned_world}, accumulate_grad_batches={planned_accumulate} but "
            f"the trainer runs world_size={world_size}, accumulate_grad_batches={actual_accumulate}; the exact loss "
            "would scale the gradient by the wrong factor. Build the plan (PlanConfig / the lit_seqpack batch "
            "sampler) with the trainer's values. Batches without plan metadata (a plain DataLoader) declare 1 and 1;"
            " for those, override seqpack_loss to return step_units=None (a local mean). With context or tensor "
            "parallelism the planned world size counts data x context x tensor parallel ranks."
        )


class FabricAccumulation:
    """The gradient accumulation of a Fabric loop: backward without sync until the step, and a check per batch.

    Args:
        fabric: the launched ``lightning.fabric.Fabric``.
        accumulate_grad_batches: microbatches per rank per optimizer step.
    """

    def __init__(self, fabric: Any, *, accumulate_grad_batches: int = 1) -> None:
        self.fabric = fabric
        self.accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
        self.microbatches = 0

    def check(self, batch: Mapping[str, Any]) -> None:
        """Raise ``ValueError`` unless ``batch`` was planned for this loop's world size, mesh and accumulation."""
        check_batch_layout(
            batch,
            world_size=int(self.fabric.world_size),
            accumulate_grad_batches=self.accumulate_grad_batches,
            strategy=getattr(self.fabric, "strategy", None),
        )

    def backward(self, model: Any, loss: torch.Tensor, batch: Mapping[str, Any]) -> bool:
        """Back-propagate one microbatch's loss; ``True`` when the optimizer should step now.

        Args:
            model: the module returned by ``fabric.setup`` (its gradient sync is skipped until the last microbatch).
            loss: the microbatch's loss (the mixin's ``training_step`` value, exactly normalised over the step).
            batch: the microbatch, checked against the loop's layout.

        Raises:
            ValueError: the batch was planned for another world size, device mesh or accumulation.
        """
        self.check(batch)
        self.microbatches += 1
        last = self.microbatches % self.accumulate_grad_batches == 0
        with self.fabric.no_backward_sync(model, enabled=not last):
            self.fabric.backward(loss / self.accumulate_grad_batches)
        return last
