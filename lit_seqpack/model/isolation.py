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

Instruments for :func:`~lit_seqpack.model.isolation.probe_packing_isolation`: taps, recorders, localisation.

Private: forward hooks that turn input embeddings into gradient leaves, record every leaf module's input and
output in execution order, and (for transformers models) record which calls of lit_seqpack's attention function
received the packed boundaries; the search for the first module whose output depends on another document; and
:func:`outside_training`, the conditions the probe's own pass runs under (eager, parameters frozen), so that it
neither breaks a compiled graph nor touches a parameter's gradient, also under reentrant activation checkpointing.

The isolation probe's refusal (:class:`PackingLeakError` and its message, naming the real cause) and its lengths.

:class:`PackingLeakError` is defined here, below both the probe (:mod:`lit_seqpack.model.isolation`, its public
home) and the transformers glue (:mod:`lit_seqpack.model.hf`), which both raise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_seqpack._imports import require
from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.model._hf_packed import ATTENTION_NAME, hf_model_inputs, missing_kernel_error

__all__ = [
    "IsolationReport",
    "PackingLeakError",
    "PackingReport",
    "check_packing_equivalence",
    "documents_batch",
    "probe_packing_isolation",
    "Trace",
    "cross_document_entries",
    "first_leaking_module",
    "has_reentrant_checkpoint",
    "outside_training",
    "tracing",
    "MAX_PROBE_LENGTH",
    "leak_message",
    "probe_lengths",
]


class PackingLeakError(RuntimeError):
    """A model's outputs on a packed row depend on other documents of the row."""


MAX_PROBE_LENGTH = 384
"""The longest probe document: a layer that mixes documents only past this many tokens is not seen."""

_SIZE_WORDS = ("conv", "kernel", "window", "cache")  # conv_L_cache, mamba_d_conv, sliding_window, ...
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length")


def _config_items(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every config carried by ``model``'s modules, nested sub-configs flattened."""
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        stack = [_as_dict(config)]
        while stack:
            for key, value in stack.pop().items():
                if isinstance(value, dict):
                    stack.append(value)
                else:
                    yield key, value


def _as_dict(config: Any) -> dict[str, Any]:
    """A transformers config's ``to_dict()``, a dataclass's or plain object's attributes."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if hasattr(config, "__dict__"):
        return dict(vars(config))
    return {name: getattr(config, name) for name in getattr(config, "__slots__", ()) if hasattr(config, name)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


def probe_lengths(model: torch.nn.Module) -> tuple[int, ...]:
    """Three document lengths past every conv kernel, SSM chunk and window the model's config declares.

    At most :data:`MAX_PROBE_LENGTH` and the config's largest position each; their sum is a prime, so the
    sequence axis of an intermediate tensor is recognised by its size.
    """
    items = list(_config_items(model)) if isinstance(model, torch.nn.Module) else []
    sizes = [v for k, v in items if _is_int(v) and any(w in k.lower() for w in _SIZE_WORDS) and v > 0]
    positions = [v for k, v in items if _is_int(v) and k in _POSITION_KEYS and v > 0]
    cap = min([MAX_PROBE_LENGTH, *positions])
    base = min(max([8, *sizes]) + 4, cap)
    lengths = [min(base + 9, cap), min(base + 5, cap), base]
    while not _is_prime(sum(lengths)) and lengths[-1] < cap:  # grow the shortest (never below a window) ...
        lengths[-1] += 1
    while not _is_prime(sum(lengths)) and lengths[0] > 2:  # ... or, at the cap, shorten the first
        lengths[0] -= 1
    return tuple(lengths)


def _named(model: torch.nn.Module, module: torch.nn.Module) -> tuple[str, str]:
    """``(path, parent path)`` of ``module`` inside ``model`` (``"<root>"`` for the model itself)."""
    for name, candidate in model.named_modules():
        if candidate is module:
            return name or "<root>", name.rpartition(".")[0] or "<root>"
    return "?", "?"


def _describe(model: torch.nn.Module, path: str) -> str:
    module = model if path == "<root>" else model.get_submodule(path)
    return f"{path} ({type(module).__name__})"


def _cause(model: torch.nn.Module, trace: Trace, culprit: tuple[str, torch.nn.Module, bool] | None) -> str:
    dropped = [m for m, got in trace.attention_calls if not got]
    if dropped:
        path, parent = _named(model, dropped[0])
        return (
            f"the attention function {ATTENTION_NAME!r} was called without the packed boundaries (cu_seq_lens_q/k) "
            f"in {_describe(model, path)}: its caller {_describe(model, parent)} does not pass its keyword arguments "
            "on to attention (the decoder layer drops **kwargs), so attention ran causally over the whole row. The "
            "varlen attention is already selected (HFCausalLM / prepare_hf_model did that); the model's own code "
            "loses the boundaries."
        )
    if trace.attention_wrapped and not trace.attention_calls:
        return (
            f"the config selects the attention function {ATTENTION_NAME!r} but no layer called it: the model does "
            "not dispatch attention through transformers' AttentionInterface."
        )
    if culprit is None and trace.reentrant:
        return (
            "no layer can be named under reentrant activation checkpointing (use_reentrant=True runs the "
            "checkpointed layers without an autograd graph, so their outputs cannot be searched); probe once with "
            "use_reentrant=False or without checkpointing to have the first mixing layer named."
        )
    if culprit is None:
        return "no single module could be named (the mixing happens outside the modules the probe can see)."
    name, module, input_leaks = culprit
    path, parent = _named(model, module)
    if input_leaks:
        where = f"in the forward of {_describe(model, parent)} itself, before its submodule {path}"
    else:
        where = f"in {_describe(model, path)}, a submodule of {_describe(model, parent)}"
    parent_type = type(model if parent == "<root>" else model.get_submodule(parent)).__name__
    mixer = isinstance(module, torch.nn.modules.conv._ConvNd) or any(
        word in (path + parent_type).lower() for word in ("conv", "mamba", "ssm", "mixer", "recurrent")
    )
    if mixer:
        hint = (
            "This layer mixes neighbouring tokens without the packed boundaries (a convolution or state-space "
            "layer needs a varlen-aware kernel for packing, which it does not have here)."
        )
    else:
        hint = (
            "Attention there must use the packed boundaries (lit_seqpack.varlen_attention with cu_seqlens); for a "
            "transformers model use HFCausalLM, or prepare_hf_model and hf_model_inputs (which also pass "
            "use_cache=False)."
        )
    return f"the first output that depends on another document appears {where}. {hint}"


def leak_message(
    model: torch.nn.Module,
    report: IsolationReport | None,
    leaking: int,
    culprit: tuple[str, torch.nn.Module, bool] | None,
    trace: Trace,
    *,
    training: bool | None = None,
) -> str:
    """The :class:`~lit_seqpack.model.isolation.PackingLeakError` message: what leaked, where, why, what to do.

    ``report`` is ``None`` when the forward itself was refused (an attention call without the boundaries).
    """
    mode = "train" if (report.training if report is not None else training) else "eval"
    if report is None:
        what = f"({mode} mode): an attention layer lost the packed boundaries."
    else:
        counted = "gradient entries" if report.method == "gradient" else "logits that changed"
        what = (
            f"({mode} mode, {str(report.dtype).removeprefix('torch.')}; probe lengths {list(report.lengths)}): "
            f"document {leaking + 1} of {len(report.lengths)} depends on the other documents "
            f"({report.cross_entries[leaking]} nonzero {counted}, exactly 0 required)."
        )
    return (
        f"{type(model).__name__} does not keep the documents of a packed row apart {what} Cause: "
        f"{_cause(model, trace, culprit)} Train it with mode: dynamic (or padded), where every row holds one "
        "document: that is exact for this model; packing is refused."
    )


@dataclass
class Trace:
    """What one instrumented forward saw.

    Args:
        leaves: the outputs of the embedding modules fed by the row (``[1, T, ...]``), as gradient leaves.
        outputs: ``(name, module, input, output)`` of every leaf module, in the order they finished.
        attention_calls: ``(module, got_boundaries)`` per call of lit_seqpack's transformers attention function.
        attention_wrapped: whether the model uses lit_seqpack's transformers attention function at all.
        reentrant: whether the row ran through reentrant activation checkpointing (``use_reentrant=True``): the
            gradients are then taken with ``backward()`` (``torch.autograd.grad`` is refused there), and the outputs
            inside checkpointed blocks, computed without a graph, cannot be searched for the first leaking module.
    """

    leaves: list[torch.Tensor] = field(default_factory=list)
    outputs: list[tuple[str, torch.nn.Module, torch.Tensor | None, torch.Tensor]] = field(default_factory=list)
    attention_calls: list[tuple[torch.nn.Module, bool]] = field(default_factory=list)
    attention_wrapped: bool = False
    reentrant: bool = False


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        return _first_tensor(list(value.values()))
    return getattr(value, "last_hidden_state", None) if hasattr(value, "last_hidden_state") else None


@contextlib.contextmanager
def tracing(model: torch.nn.Module, row_shape: tuple[int, ...]) -> Iterator[Trace]:
    """Instrument ``model`` for one forward over a row of ``row_shape`` (``[1, T]``); hooks removed on exit."""
    trace, handles = Trace(), []

    def tap(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor) and output.is_floating_point() and tuple(output.shape[:2]) == row_shape:
            leaf = output.detach().requires_grad_(True)
            trace.leaves.append(leaf)
            return leaf
        return None

    def record(name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            out = _first_tensor(output)
            if out is not None and out.is_floating_point() and out.requires_grad:
                trace.outputs.append((name, module, _first_tensor((args, kwargs)), out))

        return hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding):
            handles.append(module.register_forward_hook(tap))
        elif not any(True for _ in module.children()):
            handles.append(module.register_forward_hook(record(name), with_kwargs=True))
    try:
        with _recording_attention(model, trace):
            yield trace
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _recording_attention(model: torch.nn.Module, trace: Trace) -> Iterator[None]:
    """Wrap lit_seqpack's registered transformers attention function to record whether calls got ``cu_seq_lens``."""
    configs = [getattr(m, "config", None) for m in model.modules()]
    if not any(getattr(c, "_attn_implementation", None) == ATTENTION_NAME for c in configs):
        yield
        return
    interface = require("transformers", purpose="tracing a transformers model").AttentionInterface
    original = interface._global_mapping[ATTENTION_NAME]

    def recording(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        trace.attention_calls.append((module, kwargs.get("cu_seq_lens_q") is not None))
        return original(module, *args, **kwargs)

    trace.attention_wrapped = True
    interface.register(ATTENTION_NAME, recording)
    try:
        yield
    finally:
        interface.register(ATTENTION_NAME, original)


@contextlib.contextmanager
def outside_training(model: Any) -> Iterator[None]:
    """The probe's own pass: it leaves no trace on the model, the RNG or a compiled graph.

    Inside the block compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``: a compiled model,
    ``model.compile()`` or ``torch.compile``, runs its Python code, so the probe's hooks and shapes never reach a
    compiled graph: no graph break, no guard failure, no extra graph; the graphs compiled for training are reused
    unchanged afterwards) and every leaf parameter is frozen (so no parameter gradient, and no hook on one such as DDP's
    reducer or FSDP2's, is reached by the probe's backward passes, whichever way they are taken). On exit the
    parameters' ``requires_grad``, the buffers and the RNG states (CPU and the model's CUDA devices) are restored.
    """
    if not isinstance(model, torch.nn.Module):
        with _eager():
            yield
        return
    # only leaves can be frozen: FSDP1's parameters are views of its flat parameter (their probe gradients reach the
    # flat parameter's hooks as they did before this block froze anything, and the probe's pass is discarded there)
    params = [p for p in model.parameters() if p.requires_grad and p.is_leaf]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        for param in params:
            param.requires_grad_(False)
        with torch.random.fork_rng(devices=devices), _eager():
            yield
    finally:
        for param in params:
            param.requires_grad_(True)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs eagerly inside (torch >= 2.6; older versions compile the probe's pass too)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def has_reentrant_checkpoint(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s autograd graph holds a reentrant ``torch.utils.checkpoint`` block."""
    seen: set[int] = set()
    stack = [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        stack.extend(child for child, _ in node.next_functions)
    return False


def _leaf_grads(output: torch.Tensor, leaves: list[torch.Tensor], reentrant: bool) -> list[torch.Tensor | None]:
    """The gradients of the scalar ``output`` on ``leaves`` (the graph is kept for the next call).

    Reentrant checkpointing refuses ``torch.autograd.grad``; there a plain ``backward()`` accumulates into the
    leaves' ``.grad`` (the parameters are frozen by :func:`outside_training`, so nothing else is touched).
    """
    if not reentrant:
        return list(torch.autograd.grad(output, leaves, retain_graph=True, allow_unused=True))
    for leaf in leaves:
        leaf.grad = None
    output.backward(retain_graph=True)
    grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    return grads


def cross_document_entries(
    target: torch.Tensor,
    leaves: list[torch.Tensor],
    start: int,
    end: int,
    generator: torch.Generator,
    *,
    reentrant: bool = False,
) -> tuple[int, int]:
    """Nonzero gradient entries of a random projection of ``target``'s rows ``[start, end)`` on the leaves.

    ``target`` is ``[T, ...]`` (the sequence axis first). Returns ``(outside, inside)``: the count on the leaves'
    positions outside ``[start, end)`` (a leak when > 0) and inside it (0 means the probe sees no dependence).
    ``reentrant``: the graph holds reentrant checkpointing (see :func:`has_reentrant_checkpoint`).
    """
    part = target[start:end].float()
    weights = torch.randn(part.shape, generator=generator).to(part.device)
    grads = _leaf_grads((part * weights).sum(), leaves, reentrant)
    outside = inside = 0
    for grad in grads:
        if grad is None:
            continue
        grad = grad[0]  # [T, ...]
        inside += int(torch.count_nonzero(grad[start:end]))
        outside += int(torch.count_nonzero(grad[:start])) + int(torch.count_nonzero(grad[end:]))
    return outside, inside


def sequence_first(tensor: torch.Tensor, length: int) -> torch.Tensor | None:
    """``tensor`` with its sequence axis (size ``length``) moved to the front; ``None`` when it has none.

    An axis a little longer than ``length`` (a causal convolution padded by ``kernel - 1``) is cut to its first
    ``length`` positions, the causal outputs.
    """
    for longer in (0, *range(1, 65)):
        for axis, size in enumerate(tensor.shape):
            if size == length + longer:
                return tensor.movedim(axis, 0)[:length]
    return None


def first_leaking_module(
    trace: Trace, length: int, start: int, end: int, seed: int = 0
) -> tuple[str, torch.nn.Module, bool] | None:
    """The first leaf module (execution order) whose output at ``[start, end)`` depends on other documents.

    Returns ``(name, module, input_leaks)``; ``input_leaks`` says that the module's input already depended on other
    documents (the leak arose in code between modules, inside the module's parent). ``None`` when none is found.
    A binary search over the recorded outputs (once the residual stream carries another document, every later
    output that reads it does too), so a 32-layer model costs about 12 partial backward passes.
    """
    generator = torch.Generator().manual_seed(seed)

    def leaks(tensor: torch.Tensor | None) -> bool:
        view = None if tensor is None or not tensor.requires_grad else sequence_first(tensor, length)
        if view is None:
            return False
        return cross_document_entries(view, trace.leaves, start, end, generator, reentrant=trace.reentrant)[0] > 0

    candidates = [entry for entry in trace.outputs if sequence_first(entry[3], length) is not None]
    low, high = 0, len(candidates)  # invariant: candidates[:low] do not leak, candidates[high:] start with a leak
    while low < high:
        middle = (low + high) // 2
        if leaks(candidates[middle][3]):
            high = middle
        else:
            low = middle + 1
    if low == len(candidates):
        return None
    name, module, inputs, _ = candidates[low]
    return name, module, leaks(inputs)


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
