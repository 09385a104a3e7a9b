"""Instruments for :func:`~lit_seqpack.model.isolation.probe_packing_isolation`: taps, recorders, localisation.

Private: forward hooks that turn input embeddings into gradient leaves, record every leaf module's input and
output in execution order, and (for transformers models) record which calls of lit_seqpack's attention function
received the packed boundaries; the search for the first module whose output depends on another document; and
:func:`outside_training`, the conditions the probe's own pass runs under (eager, parameters frozen), so that it
neither breaks a compiled graph nor touches a parameter's gradient, also under reentrant activation checkpointing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_seqpack._imports import require
from lit_seqpack.model._hf_packed import ATTENTION_NAME

__all__ = [
    "Trace",
    "cross_document_entries",
    "first_leaking_module",
    "has_reentrant_checkpoint",
    "outside_training",
    "tracing",
]


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
