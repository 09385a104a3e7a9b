"""Do the documents of a packed row stay apart? A structural probe, and a logit comparison.

:func:`probe_packing_isolation` (run once per module, process and train/eval mode by
:class:`~lit_seqpack.model.mixin.PackedSequenceMixin`) measures *structure*, not magnitude: it packs three
documents in one row, makes the outputs of the model's embedding modules gradient leaves and requires the gradient
of each document's logits with respect to every *other* document's embeddings to be exactly zero. A leak of any
size (a convolution reaching 3 tokens into the next document, a state-space layer carrying state over) gives
nonzero entries; a tolerance on the logits would let small leaks through (LFM2 at random init: 7.5e-4).

:func:`check_packing_equivalence` compares a batch's logits with each document run alone (a numerical report, for
users and benchmarks); :func:`documents_batch` builds contract batches of whole documents for both.

Model-agnostic: any module with ``seqpack_forward`` (the mixin), or a transformers causal LM called through
:func:`~lit_seqpack.model.hf.hf_model_inputs`; a ``DistributedDataParallel``-style wrapper (``.module``) is
unwrapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.model._hf_packed import hf_model_inputs, missing_kernel_error
from lit_seqpack.model._isolation_trace import (
    cross_document_entries,
    first_leaking_module,
    has_reentrant_checkpoint,
    outside_training,
    tracing,
)
from lit_seqpack.model._leak_message import PackingLeakError, leak_message, probe_lengths

__all__ = [
    "IsolationReport",
    "PackingLeakError",
    "PackingReport",
    "check_packing_equivalence",
    "documents_batch",
    "probe_packing_isolation",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class PackingReport:
    """Result of :func:`check_packing_equivalence`.

    Args:
        document_errors: per document, the largest absolute logit difference between the batch and the
            document alone.
        tolerance: the largest difference accepted.
    """

    document_errors: tuple[float, ...]
    tolerance: float

    @property
    def max_error(self) -> float:
        """The largest difference over all documents."""
        return max(self.document_errors, default=0.0)

    @property
    def passed(self) -> bool:
        """Whether every document is within ``tolerance``."""
        return self.max_error <= self.tolerance


@dataclass(frozen=True, kw_only=True, slots=True)
class IsolationReport:
    """Result of :func:`probe_packing_isolation`.

    Args:
        lengths: the probe's document lengths.
        cross_entries: per document, the nonzero gradient entries of its logits on the other documents' embeddings.
        training: the mode the probe ran in (the module's own).
        dtype: the logits' dtype (the precision the model ran in, autocast included).
        method: ``"gradient"`` (embedding leaves) or ``"perturbation"`` (no embedding module found: each
            document's tokens are changed and the other documents' logits must stay bitwise equal).
    """

    lengths: tuple[int, ...]
    cross_entries: tuple[int, ...]
    training: bool
    dtype: torch.dtype
    method: str

    @property
    def passed(self) -> bool:
        """Whether no document depends on another."""
        return not any(self.cross_entries)


def documents_batch(documents: Sequence[torch.Tensor], *, packed: bool = True) -> dict[str, Any]:
    """A contract batch of whole documents (1-D token tensors on one device): one packed row or padded rows.

    Every token but each document's first is a target. Padded rows are right-padded with token 0.

    Example:
        >>> b = documents_batch([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
        >>> b["position_ids"].tolist(), b["cu_seqlens"].tolist(), b["labels"].tolist()
        ([[0, 1, 2, 0, 1]], [0, 3, 5], [[-100, 6, 7, -100, 9]])
    """
    if not documents or any(d.ndim != 1 or d.numel() == 0 for d in documents):
        raise ValueError(f"documents must be non-empty 1-D tensors, got shapes {[tuple(d.shape) for d in documents]}")
    device, lengths = documents[0].device, [int(d.numel()) for d in documents]
    if packed:
        input_ids = torch.cat(list(documents)).long()[None]
        position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        bounds = torch.tensor([0, *lengths], device=device).cumsum(0)
        extra: dict[str, Any] = {"cu_seqlens": bounds.to(torch.int32), "max_seqlen": max(lengths)}
        labels = input_ids.masked_fill(position_ids == 0, IGNORE_INDEX)
    else:
        width = max(lengths)
        input_ids = torch.zeros(len(lengths), width, dtype=torch.long, device=device)
        for row, doc in enumerate(documents):
            input_ids[row, : len(doc)] = doc
        position_ids = torch.arange(width, device=device).expand(len(lengths), -1)
        extra = {"attention_mask": (position_ids < torch.tensor(lengths, device=device)[:, None]).long()}
        labels = input_ids.masked_fill((position_ids == 0) | (extra["attention_mask"] == 0), IGNORE_INDEX)
    num_loss_tokens = sum(lengths) - len(lengths)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        **extra,
        "num_documents": len(lengths),
        "num_real_tokens": sum(lengths),
        "num_padding_tokens": input_ids.numel() - sum(lengths),
        "num_loss_tokens": num_loss_tokens,
        "step_loss_tokens": num_loss_tokens,
        "world_size": 1,
        "accumulate_grad_batches": 1,
        "max_tokens": None,
        "is_empty": False,
    }


def check_packing_equivalence(
    model: Any, batch: Mapping[str, Any], *, atol: float = 1e-5, strict: bool = False
) -> PackingReport:
    """Compare a batch's logits with the logits of each of its documents run alone (eval mode, no grad).

    Args:
        model: a module with ``seqpack_forward`` (a :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`), or a
            transformers causal LM, called with :func:`~lit_seqpack.model.hf.hf_model_inputs` (prepare it with
            :func:`~lit_seqpack.model.hf.prepare_hf_model`).
        batch: a packed row (documents are its first ``num_documents`` segments) or a padded ``[B, L]`` batch
            (each row is a document of ``attention_mask.sum()`` tokens).
        atol: the largest absolute logit difference accepted.
        strict: raise :class:`PackingLeakError` instead of returning a failed report.
    """
    if atol < 0:
        raise ValueError(f"atol must be >= 0, got {atol}")
    model = _unwrap(model)
    forward = _forward_fn(model)
    packed = batch.get("cu_seqlens") is not None
    errors = []
    with _evaluation(model):
        logits = forward(batch).float()
        for row, start, end in _documents(batch):
            alone = forward(documents_batch([batch["input_ids"][row, start:end]], packed=packed)).float()
            errors.append((logits[row, start:end] - alone[0]).abs().max().item())
    report = PackingReport(document_errors=tuple(errors), tolerance=atol)
    if strict and not report.passed:
        raise PackingLeakError(
            f"packed logits differ from per-document logits by up to {report.max_error:.3g} (atol={atol}); errors "
            f"per document: {[f'{e:.3g}' for e in errors]}"
        )
    return report


@torch.compiler.disable  # reached from a compiled step, it runs outside the graph (never traced)
def probe_packing_isolation(
    model: Any, batch: Mapping[str, Any], *, lengths: Sequence[int] | None = None
) -> IsolationReport:
    """Raise :class:`PackingLeakError` unless every document of a packed row depends on itself only.

    Three documents (tokens drawn from ``batch``, lengths past the model's conv kernels, SSM chunks and attention
    windows as its config declares them, capped at 384) are packed in one row and run once, in the module's
    current train/eval mode and under whatever autocast is active (inside a ``training_step``: the Trainer's
    precision). The outputs of every ``nn.Embedding`` fed by the row become gradient leaves; per document, the
    gradient of a random projection of its logits on the other documents' embeddings must be exactly zero.
    Dropout cannot fake or hide a leak (its masks are per token), the RNG state and the buffers are restored
    afterwards and no parameter gradient is touched. On a leak the message names the first module whose output
    depends on another document, and for transformers models an attention call that never received the packed
    boundaries (a decoder layer dropping ``**kwargs``).

    What it cannot see: code paths its shapes do not take (a kernel chosen only past 384 tokens or for more
    documents), data-dependent mixing that its tokens do not trigger (MoE capacity limits), paths whose weights
    are exactly zero at the moment (a zero-initialised gate leaks only after training moves it), and dependence
    through integer inputs (token ids, positions) other than the embeddings. Without an ``nn.Embedding`` it
    falls back to changing each document's tokens and requiring the other documents' logits to stay bitwise equal.
    Tested on CPU, alone and under DDP (it runs inside the training step, on the module DDP wraps); under FSDP or
    model-parallel strategies it runs like any forward of the sharded module, untested here.

    Its pass is its own: compiled code (``model.compile()``, ``torch.compile`` of the model or of the step) runs
    eagerly for it, so it adds no graph break and no graph; the parameters are frozen during it, so reentrant
    activation checkpointing (``use_reentrant=True``, where ``torch.autograd.grad`` is refused) is probed with plain
    ``backward()`` passes into the embedding leaves.

    Args:
        model: a module with ``seqpack_forward``, a transformers causal LM, or a ``.module`` wrapper of either.
        batch: a packed row of the training data (its tokens and device are used).
        lengths: the probe's document lengths (default: from the model's config, see above).
    """
    model = _unwrap(model)
    forward = _forward_fn(model)
    lengths = tuple(lengths) if lengths is not None else probe_lengths(model)
    training = bool(getattr(model, "training", False))
    # validation runs in inference mode; the probe's own pass leaves no trace (see outside_training)
    with outside_training(model), torch.inference_mode(False), torch.enable_grad():
        docs = _probe_documents(batch, lengths)
        row = documents_batch(docs)
        bounds = row["cu_seqlens"].tolist()
        with tracing(model, tuple(row["input_ids"].shape)) as trace:
            try:
                logits = forward(row)
            except PackingLeakError as err:  # the attention refused a call that lost the boundaries: name the caller
                if not any(not got for _, got in trace.attention_calls):
                    raise
                raise PackingLeakError(leak_message(model, None, 0, None, trace, training=training)) from err
            except ValueError as err:  # transformers refused the packed row for a missing kernel: say what is exact
                refusal = missing_kernel_error(model, err)
                if refusal is None:
                    raise
                raise refusal from err
        trace.reentrant = has_reentrant_checkpoint(logits)
        if not trace.leaves:
            cross = _perturbation_entries(forward, docs, logits)
            method = "perturbation"
        else:
            generator = torch.Generator().manual_seed(0)
            counts = [
                cross_document_entries(logits[0], trace.leaves, s, e, generator, reentrant=trace.reentrant)
                for s, e in _pairs(bounds)
            ]
            if not any(inside for _, inside in counts):
                raise PackingLeakError(
                    f"{type(model).__name__}: the isolation probe found no dependence of the logits on the outputs "
                    "of the model's nn.Embedding modules, so it cannot check that packed documents stay apart; "
                    "override seqpack_verify_packing to check the model another way"
                )
            cross, method = [outside for outside, _ in counts], "gradient"
        report = IsolationReport(
            lengths=lengths, cross_entries=tuple(cross), training=training, dtype=logits.dtype, method=method
        )
        if not report.passed:
            leaking = next(i for i, c in enumerate(cross) if c)
            start, end = _pairs(bounds)[leaking]
            searchable = method == "gradient" and not trace.reentrant  # reentrant blocks run without a graph
            culprit = first_leaking_module(trace, sum(lengths), start, end) if searchable else None
            raise PackingLeakError(leak_message(model, report, leaking, culprit, trace))
    return report


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _probe_documents(batch: Mapping[str, Any], lengths: Sequence[int]) -> list[torch.Tensor]:
    """Documents of ``lengths`` tokens drawn (seeded) from ``batch``'s tokens, on its device."""
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"probe lengths must be >= 1, got {tuple(lengths)}")
    pool = batch["input_ids"].reshape(-1)
    index = torch.randint(0, pool.numel(), (sum(lengths),), generator=torch.Generator().manual_seed(0))
    tokens = pool[index.to(pool.device)].clone().long()
    return list(torch.split(tokens, list(lengths)))


def _perturbation_entries(
    forward: Callable[[Mapping[str, Any]], torch.Tensor], docs: list[torch.Tensor], logits: torch.Tensor
) -> list[int]:
    """Per document: logits entries of the *other* documents that change when its tokens change."""
    bounds = [0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()]
    cross = []
    with torch.no_grad():
        for i, doc in enumerate(docs):
            changed = list(docs)
            changed[i] = doc.flip(0).roll(1)  # other tokens at most positions (best effort: from the same pool)
            other = forward(documents_batch(changed))
            keep = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[bounds[i] : bounds[i + 1]] = False
            cross.append(int(torch.count_nonzero(other[0, keep] != logits.detach()[0, keep])))
    return cross


def _unwrap(model: Any) -> Any:
    """The module inside ``DistributedDataParallel``-style wrappers (``.module``) that lack ``seqpack_forward``."""
    while not hasattr(model, "seqpack_forward") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _forward_fn(model: Any) -> Callable[[Mapping[str, Any]], torch.Tensor]:
    if hasattr(model, "seqpack_forward"):
        return model.seqpack_forward
    return lambda batch: model(**hf_model_inputs(batch)).logits


def _documents(batch: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of a contract batch."""
    if batch.get("cu_seqlens") is not None:
        bounds = batch["cu_seqlens"].tolist()
        count = batch.get("num_documents", len(bounds) - 1)
        return [(0, bounds[i], bounds[i + 1]) for i in range(count) if bounds[i + 1] > bounds[i]]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    return [(row, 0, int(n)) for row, n in enumerate(lengths) if n > 0]


@contextlib.contextmanager
def _evaluation(model: Any) -> Iterator[None]:
    """Eval mode and no grad inside the block; every submodule's own mode is restored after it."""
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, torch.nn.Module) else []
    if isinstance(model, torch.nn.Module):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
