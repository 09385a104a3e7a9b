"""The collators' checks of a microbatch against its plan: each sample's length, the token budget, the loss tokens.

The plan was made from lengths and loss tokens computed before training (a scan, a lengths cache, or arrays the
dataset declares). A sample read later with another length (a dataset whose samples change between epochs, a file
re-tokenised behind the same object, a stale cache) would pack rows far above ``max_tokens`` and be trained under
the wrong loss normaliser without an error: on a GPU an out-of-memory or ``max_seq_len`` error far from its cause.
Each check is one comparison per microbatch; a failure names the sample by its dataset index.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lit_seqpack.data.batching._samples import sample_name

__all__ = ["check_planned_budget", "check_planned_lengths", "check_planned_loss_tokens"]

_CAUSES = (
    "Samples that change between epochs (augmentation, a prompt that grows, a file re-tokenised behind the same "
    "dataset) must say so: set lengths_change_per_epoch = True on the dataset and it is re-scanned every epoch. A "
    "stale lengths cache (content changed behind the same fingerprint or key) is cleared by deleting cache_dir; a "
    "dataset's own lengths attribute must match its samples"
)


def check_planned_lengths(samples: Sequence[Any], sizes: Sequence[int], meta: Any, multiple: int = 1) -> None:
    """Refuse a microbatch whose samples do not have the lengths the plan was made with.

    Args:
        samples: the microbatch (a :class:`~lit_seqpack.batch.Microbatch` names the dataset indices).
        sizes: each sample's number of tokens.
        meta: the microbatch's :class:`~lit_seqpack.batch.MicrobatchMeta` (``None`` or no ``lengths``: unchecked).
        multiple: the per-document pad multiple the planned lengths are rounded to (packing with
            ``pad_to_multiple_of``), so a planned length is ``ceil(length / multiple) * multiple``.

    Raises:
        ValueError: naming the first sample that differs, its planned and actual length and the likely causes.

    Example:
        >>> from lit_seqpack.batch import MicrobatchMeta
        >>> meta = MicrobatchMeta(step=0, step_loss_tokens=2, world_size=1, accumulate_grad_batches=1, lengths=(3,))
        >>> check_planned_lengths([{}], [3], meta)
    """
    planned = None if meta is None else meta.lengths
    if planned is None:
        return
    # plain Python ints: a list comparison of a microbatch's lengths costs about a microsecond, numpy's set-up more
    actual = list(sizes) if multiple == 1 else [-(-size // multiple) * multiple for size in sizes]
    if actual == list(planned):
        return
    if len(planned) != len(actual):
        raise ValueError(f"the plan gives {len(planned)} sample lengths for a microbatch of {len(actual)} samples")
    i = next(k for k, (want, have) in enumerate(zip(planned, actual, strict=True)) if want != have)
    padded = f" ({int(actual[i])} padded to a multiple of {multiple})" if multiple > 1 else ""
    raise ValueError(
        f"{sample_name(samples, i)} has {sizes[i]} tokens{padded} but the plan was made with a length of "
        f"{int(planned[i])}: its rows would not hold the planned budget. {_CAUSES}"
    )


def check_planned_budget(samples: Sequence[Any], docs: Sequence[np.ndarray], slots: int, meta: Any) -> None:
    """Refuse a microbatch that takes more token slots than the plan's budget: its samples grew after planning.

    Catches what :func:`check_planned_lengths` cannot see when the plan's lengths did not travel with the
    microbatch (a hand-built :class:`~lit_seqpack.batch.MicrobatchMeta`).

    Raises:
        ValueError: naming the budget, the slots and the longest samples with their dataset indices.
    """
    budget = None if meta is None else meta.max_tokens
    if budget is None or slots <= budget:
        return
    longest = sorted(range(len(docs)), key=lambda i: -len(docs[i]))[:3]
    named = ", ".join(f"{sample_name(samples, i)}: {len(docs[i])} tokens" for i in longest)
    raise ValueError(
        f"this microbatch takes {slots} token slots but the plan's budget is max_tokens={budget} (longest: {named}): "
        f"its samples are longer than the lengths it was planned with. {_CAUSES}"
    )


def check_planned_loss_tokens(meta: Any, loss: int, is_empty: bool) -> None:
    """Refuse a microbatch whose labels hold other loss tokens than the plan counted (a wrong loss normaliser).

    Raises:
        ValueError: naming the planned and the actual count.
    """
    if meta is None or is_empty:
        return
    if meta.loss_tokens is not None and meta.loss_tokens != loss:
        raise ValueError(
            f"the plan counted {meta.loss_tokens} loss tokens for this microbatch but its labels hold {loss}: the "
            "step_loss_tokens normaliser would be wrong. Give the batch sampler the samples' real loss tokens "
            "(loss_tokens=lit_seqpack.data.compute_loss_tokens(dataset)); the default assumes every token "
            "but the first of each sample is trained on"
        )
    if meta.step_loss_tokens < loss:
        raise ValueError(
            f"the plan says step_loss_tokens={meta.step_loss_tokens} for this optimizer step, but this microbatch "
            f"alone has {loss} loss tokens: the loss tokens given to the planner do not match the samples' labels"
        )
