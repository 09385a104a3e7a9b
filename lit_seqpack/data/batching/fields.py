"""Open fields: extra per-token and per-sample values that travel with the tokens of a microbatch.

A sample may carry more than ``input_ids`` / ``labels`` / ``loss_mask``: old log-probabilities and advantages for
RL, teacher targets for distillation, per-token weights for weighted SFT, a reward or a group id per sample. They
are declared once, on the collators (and :class:`~lit_seqpack.data.datamodule.SeqPackDataModule`):

* ``token_fields={"advantages": 0.0, "weights": 0.0}``: name to pad value. Each sample holds a list, 1-D tensor
  or numpy array as long as its ``input_ids``; the batch holds the concatenation (packed row ``[1, T]``) or the
  padded block (``[B, L]``) under the same name, aligned with ``input_ids`` like ``labels`` (the value at position
  ``t`` belongs to token ``t``, not shifted), with the pad value on every padding position::

      docs          a a a b b b b b p p        (p = padding; pad value 0.0)
      input_ids     a a a b b b b b p p
      weights       1 1 .5 0 1 1 1 1 0 0       the samples' values, then the pad value

  The dtype is float32 when the pad value or any value of the batch is a float, int64 when all are integers (or
  booleans): declare a float pad value (``0.0``) for a float field so that every batch has the same dtype.
  Under context parallelism the shard also holds ``shift_<name>``: the value at each local token's *target* (see
  :mod:`lit_seqpack.parallel`); a loss that scores targets reads ``shift_<name>`` there, as it reads
  ``shift_labels`` instead of ``labels``.
* ``sample_fields=["reward", "group_id"]``: each sample holds one value; the batch holds a 1-D tensor
  ``[num_documents]`` in document order (the documents of ``cu_seqlens``, or the rows of a padded batch), float32
  when any value is a float, int64 otherwise; values that are not numbers (e.g. strings) arrive as a list.

Any other key of a sample is reported once per collator (a warning naming it and how to declare it), never
silently dropped. A declared name that is a key of the batch contract is refused.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lit_seqpack.batch import CONTRACT_KEYS, SHIFT_PREFIX

__all__ = [
    "CONTRACT_KEYS",
    "SAMPLE_KEYS",
    "FieldValues",
    "check_fields",
    "empty_fields",
    "pad_token_field",
    "read_fields",
    "read_sample_fields",
    "read_token_field",
    "report_undeclared",
    "sample_field_tensor",
    "scatter_tokens",
    "token_field_dtype",
]

log = logging.getLogger(__name__)

SAMPLE_KEYS = frozenset({"input_ids", "labels", "loss_mask"})
"""The keys of a sample the collators always read."""


def check_fields(
    token_fields: Mapping[str, float | int] | None, sample_fields: Sequence[str] | None
) -> tuple[dict[str, float | int], tuple[str, ...]]:
    """Validate a field declaration; return it as a ``dict`` of pad values and a ``tuple`` of names.

    Raises:
        ValueError: naming the setting and the bad name or value (a contract key, a ``shift_`` prefix, a name
            declared twice, a pad value that is not a number).

    Example:
        >>> check_fields({"weights": 0.0}, ["reward"])
        ({'weights': 0.0}, ('reward',))
    """
    if token_fields is not None and not isinstance(token_fields, Mapping):
        raise ValueError(f"token_fields must map each field name to its pad value, got {token_fields!r:.80}")
    if isinstance(sample_fields, str) or (sample_fields is not None and not isinstance(sample_fields, Sequence)):
        raise ValueError(f"sample_fields must be a list of field names, got {sample_fields!r:.80}")
    tokens, samples = dict(token_fields or {}), tuple(sample_fields or ())
    for setting, names in (("token_fields", list(tokens)), ("sample_fields", list(samples))):
        for name in names:
            _check_name(setting, name)
        if len(set(names)) != len(names):
            raise ValueError(f"{setting} names a field twice: {names}")
    for name, pad in tokens.items():
        if isinstance(pad, bool) or not isinstance(pad, (int, float, np.integer, np.floating)):
            raise ValueError(f"token_fields[{name!r}] is the pad value and must be an int or a float, got {pad!r}")
    both = sorted(set(tokens) & set(samples))
    if both:
        raise ValueError(f"{both} are declared in both token_fields and sample_fields: a field is one or the other")
    return tokens, samples


def _check_name(setting: str, name: Any) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{setting} names must be non-empty strings, got {name!r}")
    if name in CONTRACT_KEYS:
        raise ValueError(f"{setting} declares {name!r}, a key of the batch contract: rename the field")
    if name.startswith(SHIFT_PREFIX):
        raise ValueError(
            f"{setting} declares {name!r}: the prefix {SHIFT_PREFIX!r} is reserved for the target-aligned copies "
            "of token fields under context parallelism; rename the field"
        )


def report_undeclared(
    samples: Sequence[Mapping[str, Any]], declared: set[str] | frozenset[str], reported: set[str]
) -> None:
    """Warn once (per ``reported`` set) about sample keys that are neither contract keys nor declared fields.

    Args:
        samples: the microbatch's samples.
        declared: the declared field names.
        reported: the keys already reported by this collator; updated in place.
    """
    known = SAMPLE_KEYS | declared
    extra = {key for sample in samples for key in sample if key not in known} - reported
    if not extra:
        return
    reported.update(extra)
    names = sorted(map(str, extra))
    log.warning(
        "samples carry %s, which the collator does not put in the batch: declare per-token fields with "
        "token_fields={name: pad_value} and per-sample fields with sample_fields=[name] (on the collator or "
        "SeqPackDataModule), or remove the keys from the samples",
        names,
    )


def read_token_field(sample: Mapping[str, Any], sample_name: str, field: str, length: int) -> torch.Tensor:
    """The 1-D values of a declared token field of one sample, as many as its ``length`` tokens.

    Raises:
        ValueError: the field is missing, not 1-D numbers, or not as long as ``input_ids`` (naming the sample,
            the field and both lengths).
    """
    if field not in sample or sample[field] is None:
        raise ValueError(f"{sample_name}: the declared token field {field!r} is missing")
    value = sample[field]
    try:
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    except (TypeError, ValueError, OverflowError, RuntimeError):
        raise ValueError(f"{sample_name}: token field {field!r} is not a sequence of numbers ({value!r:.60})") from None
    if tensor.dim() != 1:
        raise ValueError(f"{sample_name}: token field {field!r} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.is_complex() or not (tensor.is_floating_point() or tensor.dtype == torch.bool or _is_int(tensor)):
        raise ValueError(f"{sample_name}: token field {field!r} must hold numbers, got dtype {tensor.dtype}")
    if len(tensor) != length:
        raise ValueError(
            f"{sample_name}: token field {field!r} has {len(tensor)} values but input_ids has {length} tokens"
        )
    return tensor


def _is_int(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def token_field_dtype(pad: float | int, parts: Sequence[torch.Tensor]) -> torch.dtype:
    """float32 when ``pad`` or any part is floating point, else int64.

    Example:
        >>> token_field_dtype(0, [torch.tensor([1, 2])]), token_field_dtype(0.0, [torch.tensor([1, 2])])
        (torch.int64, torch.float32)
    """
    is_float = isinstance(pad, (float, np.floating)) or any(p.is_floating_point() for p in parts)
    return torch.float32 if is_float else torch.int64


def pad_token_field(
    parts: Sequence[torch.Tensor], pad: float | int, shape: tuple[int, ...], where: slice | np.ndarray
) -> torch.Tensor:
    """A ``shape`` tensor full of ``pad`` whose positions ``where`` (of its flattened view) hold ``parts`` in order.

    Args:
        parts: each document's values.
        pad: the field's pad value.
        shape: ``(T,)`` for a packed row, ``(B, L)`` for a padded block.
        where: the flat positions of the concatenated documents (a slice, an index array or a boolean mask).

    Example:
        >>> pad_token_field([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], -1.0, (4,), slice(0, 3)).tolist()
        [1.0, 2.0, 3.0, -1.0]
    """
    dtype = token_field_dtype(pad, parts)
    values = torch.cat([p.to(dtype) for p in parts]) if parts else torch.empty(0, dtype=dtype)
    return torch.from_numpy(scatter_tokens(values, pad, shape, where))


def scatter_tokens(
    values: torch.Tensor, fill: float | int, shape: tuple[int, ...], where: slice | np.ndarray
) -> np.ndarray:
    """A ``shape`` array of ``values``' dtype full of ``fill``, with ``values`` at the flat positions ``where``.

    numpy, not torch indexing: on CPU, torch's ``index_put_`` wakes every torch thread on each call, which cost
    most of a collate with two threads on a busy machine.

    Example:
        >>> scatter_tokens(torch.tensor([5, 6]), 0, (2, 2), np.array([True, False, True, False])).tolist()
        [[5, 0], [6, 0]]
    """
    out = np.full(shape, fill, dtype=values.numpy().dtype)
    out.reshape(-1)[where] = values.numpy()
    return out


def read_sample_fields(
    samples: Sequence[Mapping[str, Any]], fields: Sequence[str], names: Sequence[str]
) -> dict[str, torch.Tensor | list[Any]]:
    """Each declared sample field of a microbatch, in sample order (see :func:`sample_field_tensor`).

    Args:
        samples: the microbatch's samples.
        fields: the declared sample field names.
        names: each sample's name for error messages.

    Raises:
        ValueError: a declared field is missing from a sample (naming the field and the sample).
    """
    out: dict[str, torch.Tensor | list[Any]] = {}
    for field in fields:
        values = []
        for sample, name in zip(samples, names, strict=True):
            if field not in sample or sample[field] is None:
                raise ValueError(f"{name}: the declared sample field {field!r} is missing")
            values.append(sample[field])
        out[field] = sample_field_tensor(values)
    return out


def sample_field_tensor(values: Sequence[Any]) -> torch.Tensor | list[Any]:
    """``values`` as a 1-D tensor when they are all numbers (float32 if any is a float, else int64), else a list.

    Example:
        >>> sample_field_tensor([1, 2]), sample_field_tensor([1, 0.5]), sample_field_tensor(["a", "b"])
        (tensor([1, 2]), tensor([1.0000, 0.5000]), ['a', 'b'])
    """
    scalars = [v.item() if isinstance(v, (torch.Tensor, np.ndarray)) and v.ndim == 0 else v for v in values]
    if not all(isinstance(v, numbers.Real) for v in scalars):
        return list(values)
    if any(isinstance(v, (float, np.floating)) for v in scalars):
        return torch.tensor([float(v) for v in scalars], dtype=torch.float32)
    return torch.tensor([int(v) for v in scalars], dtype=torch.int64)


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldValues:
    """The declared fields of one microbatch: each token field's per-document parts, each sample field's values."""

    tokens: dict[str, list[torch.Tensor]]
    samples: dict[str, torch.Tensor | list[Any]]


def read_fields(
    samples: Sequence[Mapping[str, Any]],
    docs: Sequence[np.ndarray],
    names: Sequence[str],
    token_fields: Mapping[str, float | int],
    sample_fields: Sequence[str],
    reported: set[str],
) -> FieldValues:
    """Report undeclared keys (once per ``reported`` set) and read the declared fields of every sample.

    Args:
        samples: the microbatch's samples.
        docs: each sample's ``input_ids`` (the token fields must be as long).
        names: each sample's name for error messages.
        token_fields: the declared token fields and their pad values.
        sample_fields: the declared sample fields.
        reported: the undeclared keys already reported by the caller; updated in place.
    """
    report_undeclared(samples, set(token_fields) | set(sample_fields), reported)
    tokens = {
        key: [read_token_field(s, n, key, len(d)) for s, n, d in zip(samples, names, docs, strict=True)]
        for key in token_fields
    }
    return FieldValues(tokens=tokens, samples=read_sample_fields(samples, sample_fields, names))


def empty_fields(token_fields: Mapping[str, float | int], sample_fields: Sequence[str]) -> FieldValues:
    """The fields of an empty microbatch (a lock-step filler): no token values, empty float32 sample tensors."""
    return FieldValues(
        tokens={key: [] for key in token_fields},
        samples={key: torch.empty(0, dtype=torch.float32) for key in sample_fields},
    )
