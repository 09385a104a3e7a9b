"""The isolation probe's refusal (:class:`PackingLeakError` and its message, naming the real cause) and its lengths.

:class:`PackingLeakError` is defined here, below both the probe (:mod:`lit_seqpack.model.isolation`, its public
home) and the transformers glue (:mod:`lit_seqpack.model._hf_dispatch`), which both raise it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lit_seqpack.model._hf_packed import ATTENTION_NAME

if TYPE_CHECKING:
    from lit_seqpack.model._isolation_trace import Trace
    from lit_seqpack.model.isolation import IsolationReport

__all__ = ["MAX_PROBE_LENGTH", "PackingLeakError", "leak_message", "probe_lengths"]


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
