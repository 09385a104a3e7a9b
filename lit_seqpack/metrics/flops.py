"""Useful training FLOPs of a model over documents, and the devices' peaks: the two halves of MFU.

The count is of one forward and backward pass (backward = twice forward) over the *real* tokens of documents of
lengths ``l_i``, each attending causally inside itself; a matmul of ``[n, a] x [a, b]`` is ``2 n a b`` FLOPs:

* **linear**: ``6 x N x sum(l_i)``, where ``N`` is the parameters a token goes through: every parameter but the
  embedding lookups (``nn.Embedding``), plus the output projection (also when tied to the input embedding); in a
  mixture-of-experts model the experts count ``k / E`` of their parameters (``k`` of ``E`` experts per token).
* **attention**: per layer, ``QK^T`` and ``PV`` over the causal half of each document's ``l x l`` scores:
  ``2 x 2 x width x l^2 / 2`` forward, so ``6 x n_layer x width x sum(l_i^2)`` forward and backward, ``width`` the
  query heads times the head size (``d_model`` in most models). The convention counts the causal triangle as
  ``l^2 / 2`` (its diagonal ignored), as PaLM's and Megatron's MFU do. A layer with a sliding window of ``W`` keys
  sees ``W^2 / 2 + (l - W) W`` of the scores when ``l > W``, counted as ``6 x width x (2 l W - W^2)``.

Padding and the cross-document scores of a packed row are not useful work and are not counted, so a packed, a
dynamic and a padded batch of the same documents count the same FLOPs, and MFU compares modes on one numerator.

Where the numbers come from (:meth:`FlopCount.of`): a model (or a module wrapping it, followed through ``.model``
and ``torch.compile``'s ``_orig_mod``) that has a ``training_flops(lengths)`` method states its own count; else
the reference decoder's :class:`~lit_seqpack.model.reference.ReferenceConfig` (any config with ``n_layer``,
``n_head`` and ``head_dim``), or a transformers config
(``num_hidden_layers``, ``num_attention_heads``, ``head_dim``, ``sliding_window``, ``layer_types``,
``num_experts_per_tok``), gives the attention layers, and the parameters give ``N``. Layers that are not softmax
attention (``layer_types`` such as ``linear_attention`` or ``mamba``) add no attention term.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["PEAK_FLOPS", "FlopCount", "device_peak_flops", "document_lengths", "flop_counter", "training_flops"]

PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
    ("L4", 121.0e12),
    ("A10G", 70.0e12),
    ("A10", 125.0e12),
)
"""Dense bf16 tensor-core peaks (FLOP/s) from NVIDIA's data sheets (sparsity's doubled figures not used), matched
in this order as substrings of ``torch.cuda.get_device_name`` (``"NVIDIA H100 80GB HBM3"`` is an H100 SXM)."""

_ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def device_peak_flops(device: torch.device | str) -> float:
    """The dense bf16 peak of a CUDA ``device`` from :data:`PEAK_FLOPS`.

    Raises:
        ValueError: not a CUDA device, or one the table does not know (the message names it).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(
            f"peak_flops='auto' knows CUDA devices only (got device {device.type!r}); pass peak_flops=<FLOP/s> "
            "(the device's dense peak in the training dtype)"
        )
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_FLOPS:
        if key in name:
            return peak
    known = ", ".join(key for key, _ in PEAK_FLOPS)
    raise ValueError(f"peak_flops='auto' does not know {name!r} (known: {known}); pass peak_flops=<FLOP/s>")


def document_lengths(batch: Mapping[str, Any]) -> torch.Tensor:
    """The real token count of each document of a microbatch in the batch contract, on the batch's device.

    A packed row: its first ``num_documents`` segments (``cu_seqlens_unpadded`` when the row has per-document
    padding), never the padding tail; a ``[B, L]`` batch: each row's ``attention_mask`` sum; a lock-step dummy
    (``is_empty``): none. Nothing is read on the host (no device sync). On a context-parallel shard the lengths
    are the whole row's (``cu_seqlens`` stays global there).

    Example:
        >>> row = {"cu_seqlens": torch.tensor([0, 3, 8, 10], dtype=torch.int32), "num_documents": 2}
        >>> document_lengths(row).tolist()
        [3, 5]
    """
    if batch.get("is_empty"):
        return torch.zeros(0, dtype=torch.int64)
    cu = batch.get("cu_seqlens_unpadded")
    cu = batch.get("cu_seqlens") if cu is None else cu
    if cu is not None:
        lengths = (cu[1:] - cu[:-1]).to(torch.int64)
        count = batch.get("num_documents")
        return lengths if count is None else lengths[: int(count)]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.to(torch.int64).sum(dim=1)
    raise ValueError(
        f"cannot read document lengths: no cu_seqlens and no 2-D attention_mask in the batch; keys: {sorted(batch)}"
    )


def _check_lengths(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"lengths must be document lengths (ints >= 0), got {value!r} in {values[:8]}")
    return values


@dataclass(frozen=True, kw_only=True, slots=True)
class FlopCount:
    """A model's training FLOPs as a function of document lengths (see the module docstring for the convention).

    Args:
        active_parameters: ``N``, the parameters a token goes through.
        attention_layers: one ``(width, window)`` per softmax-attention layer: query heads x head size, and the
            sliding window in keys (``None``: the whole document).

    Example:
        >>> count = FlopCount(active_parameters=1000, attention_layers=((64, None), (64, 8)))
        >>> count.linear(10), count.attention([10]), count([4, 6]) == count.linear(10) + count.attention([4, 6])
        (60000, 75264, True)
    """

    active_parameters: int
    attention_layers: tuple[tuple[int, int | None], ...]

    def linear(self, tokens: int) -> int:
        """``6 x N x tokens``."""
        return 6 * self.active_parameters * int(tokens)

    def attention(self, lengths: Sequence[int] | torch.Tensor) -> int:
        """``6 x width x (l^2, or 2 l W - W^2 beyond a window W)`` summed over layers and documents."""
        lengths = _check_lengths(lengths)
        total = 0
        for width, window in self.attention_layers:
            area = sum(n * n if window is None or n <= window else 2 * n * window - window * window for n in lengths)
            total += 6 * width * area
        return total

    def __call__(self, lengths: Sequence[int] | torch.Tensor) -> int:
        """Training FLOPs of documents of these lengths."""
        lengths = _check_lengths(lengths)
        return self.linear(sum(lengths)) + self.attention(lengths)

    @classmethod
    def of(cls, model: nn.Module) -> FlopCount:
        """Read ``model``'s count: its reference or transformers config, and its parameters.

        Raises:
            ValueError: no known config in ``model`` or the modules it wraps (give it a ``training_flops`` method).
        """
        network = _network(model)
        return cls(active_parameters=_active_parameters(network), attention_layers=_attention_layers(network))


def training_flops(model: nn.Module, lengths: Sequence[int] | torch.Tensor) -> int | float:
    """FLOPs of one forward and backward pass of ``model`` over documents of these lengths (real tokens only).

    ``model.training_flops(lengths)`` answers when the model (or a module it wraps) has one; else
    :meth:`FlopCount.of` reads the count. See the module docstring for the convention (causal attention counted
    as ``6 x n_layer x width x sum(l^2)``).

    Args:
        model: a LightningModule, a reference decoder or a transformers model (compiled or not).
        lengths: the documents' real token counts.

    Example:
        >>> from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder
        >>> model = ReferenceDecoder(ReferenceConfig.preset("tiny"))
        >>> training_flops(model, [8, 8]) == 2 * training_flops(model, [8])
        True
    """
    return flop_counter(model)(lengths)


def flop_counter(model: nn.Module) -> Callable[[Sequence[int] | torch.Tensor], int | float]:
    """``lengths -> FLOPs`` for ``model``: its own ``training_flops`` method, else :meth:`FlopCount.of` read once.

    Raises:
        ValueError: the model states no count and has no known config.
    """
    hook = _hook(model)
    if hook is None:
        return FlopCount.of(model)

    def stated(lengths: Sequence[int] | torch.Tensor) -> int | float:
        flops = hook(_check_lengths(lengths))
        if isinstance(flops, bool) or not isinstance(flops, int | float) or flops < 0:
            raise ValueError(f"{type(model).__name__}.training_flops returned {flops!r}, not a count >= 0")
        return flops

    return stated


# ------------------------------------------------------------------------------------------------ reading a model
def _chain(model: nn.Module) -> list[nn.Module]:
    """``model`` and the modules it wraps: ``_orig_mod`` (torch.compile), then ``.model`` (Lightning wrappers)."""
    chain = [model]
    while len(chain) < 16:
        current = chain[-1]
        inner = getattr(current, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "model", None) if _config(current) is None else None
        if not isinstance(inner, nn.Module) or any(inner is m for m in chain):
            break
        chain.append(inner)
    return chain


def _hook(model: nn.Module) -> Callable[[list[int]], Any] | None:
    for module in _chain(model):
        hook = getattr(module, "training_flops", None)
        if callable(hook):
            return hook
    return None


def _config(module: nn.Module) -> Any:
    """The reference or transformers config of ``module``, or ``None``."""
    config = getattr(module, "config", None)
    if _is_reference(config):
        return config
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        return config
    return None


def _is_reference(config: Any) -> bool:
    """A config shaped like :class:`~lit_seqpack.model.reference.ReferenceConfig` (metrics do not import model/)."""
    return all(isinstance(getattr(config, key, None), int) for key in ("n_layer", "n_head", "head_dim"))


def _network(model: nn.Module) -> nn.Module:
    for module in _chain(model):
        if _config(module) is not None:
            return module
    raise ValueError(
        f"cannot count the FLOPs of {type(model).__name__}: neither it nor a module it wraps (.model, _orig_mod) has "
        "a lit_seqpack ReferenceConfig or a transformers config; give it a training_flops(lengths) method"
    )


def _output_weight(network: nn.Module) -> torch.Tensor | None:
    get = getattr(network, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(network, "lm_head", None)
    if head is None and getattr(network, "lm_head", 0) is None:  # the reference decoder ties: the embedding is it
        head = getattr(network, "embed_tokens", None)
    return getattr(head, "weight", None)


def _active_parameters(network: nn.Module) -> int:
    embedding = {id(m.weight) for m in network.modules() if isinstance(m, nn.Embedding)}
    named = dict(network.named_parameters())
    total = sum(p.numel() for p in named.values() if id(p) not in embedding)
    head = _output_weight(network)
    if head is not None and id(head) in embedding:  # tied: the output projection is a matmul all the same
        total += head.numel()
    text = _text_config(_config(network))
    per_token = getattr(text, "num_experts_per_tok", None)
    experts = next((getattr(text, key) for key in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(getattr(text, key, None), int)), None)  # fmt: skip
    if isinstance(per_token, int) and experts and per_token < experts:
        in_experts = sum(p.numel() for name, p in named.items() if "experts" in name.split("."))
        total -= in_experts - in_experts * per_token // experts
    return total


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _attention_layers(network: nn.Module) -> tuple[tuple[int, int | None], ...]:
    config = _config(network)
    if _is_reference(config):
        return ((config.n_head * config.head_dim, None),) * config.n_layer
    text = _text_config(config)
    heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    types = getattr(text, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * int(
        text.num_hidden_layers
    )
    return tuple(
        (heads * int(head_dim), int(window) if kind == "sliding_attention" and window else None)
        for kind in types
        if kind in _ATTENTION_TYPES
    )
