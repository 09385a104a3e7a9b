"""The cross-rank check of a stream: every rank must read the same samples, or training stops on every rank.

Ranks plan the windows of a stream without communicating (:mod:`~lit_seqpack.data.streaming.dataset`), which is
only right when they all read the same stream. Ranks reading different shards, file versions or preprocessing with
the same lengths would train a wrong mixture of samples without any error. So each window carries a
:class:`WindowDigest` (computed where the window is planned, in the DataLoader worker), and the loader compares it
across ranks with one ``all_gather_object`` in the main process (collectives cannot run in a worker) at the first
batch of every iteration and of every window whose number is a multiple of :data:`CHECK_EVERY`. Every rank sees the
same gathered list, so every rank raises together: no rank waits for another.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch.distributed as dist

from lit_seqpack._hashing import content_digest
from lit_seqpack.data.streaming.buffer import StreamWindow

__all__ = ["CHECK_EVERY", "WindowDigest", "check_ranks_agree", "window_digest"]

CHECK_EVERY = 8
"""Windows between two cross-rank checks (besides the first window of every iteration)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WindowDigest:
    """What identifies a window's contents on one rank.

    Args:
        epoch: the epoch the window belongs to.
        window: the window's number in the epoch.
        first_sample: the stream number of its first sample (named in the error).
        lengths: digest of the lengths and loss tokens of its samples.
        tokens: digest of the tokens of a few of its samples.
    """

    epoch: int
    window: int
    first_sample: int
    lengths: str
    tokens: str


def distributed() -> bool:
    """Whether ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def window_digest(window: StreamWindow, *, epoch: int, samples: int, seed: int = 0) -> WindowDigest:
    """The digest of ``window``: all its lengths and loss tokens, and the tokens of ``samples`` of its samples.

    Args:
        window: a planned window.
        epoch: its epoch.
        samples: samples whose tokens are hashed (:func:`~lit_seqpack._hashing.sampled_indices`).
        seed: picks those samples.
    """
    lengths = np.fromiter((len(s["input_ids"]) for s in window.samples), dtype=np.int64, count=len(window.samples))
    digest = hashlib.sha256(lengths.tobytes() + np.asarray(window.loss_tokens, dtype=np.int64).tobytes())
    return WindowDigest(
        epoch=epoch,
        window=window.index,
        first_sample=window.first_sample,
        lengths=digest.hexdigest()[:16],
        tokens=content_digest(window.samples, samples, seed),
    )


def check_ranks_agree(mine: WindowDigest) -> None:
    """Compare ``mine`` with every rank's digest (one ``all_gather_object``; nothing without ``torch.distributed``).

    Raises:
        RuntimeError: on every rank when any rank's digest differs, naming the ranks, the window and what differs.
    """
    if not distributed():
        return
    everyone: list[WindowDigest | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(other == mine for other in everyone):
        return
    rank = dist.get_rank()
    others = [r for r, other in enumerate(everyone) if other != mine]
    where = f"window {mine.window} of epoch {mine.epoch} (from stream sample {mine.first_sample})"
    fix = (
        "every rank must read the whole, same stream (same files, shards, order, tokenizer and preprocessing; not "
        "a stream split by rank such as datasets' split_dataset_by_node: the loader splits each window's plan); a "
        "stream whose samples change between reads (random augmentation) needs the check off "
        "(content_check_samples=0)"
    )
    if any((o.epoch, o.window, o.first_sample) != (mine.epoch, mine.window, mine.first_sample) for o in everyone):
        at = [(o.epoch, o.window, o.first_sample) for o in everyone]
        raise RuntimeError(
            f"rank {rank} reads a different stream than ranks {others}: the ranks are at different windows "
            f"(epoch, window, first stream sample per rank: {at}) at the same check; {fix}"
        )
    if any(o.lengths != mine.lengths for o in everyone):
        raise RuntimeError(
            f"rank {rank} reads a different stream than ranks {others}: the lengths of the samples of {where} differ "
            f"(digest {mine.lengths} vs {[everyone[r].lengths for r in others]}); {fix}"
        )
    raise RuntimeError(
        f"rank {rank} reads a different stream than ranks {others}: the lengths of {where} agree but the tokens of "
        f"the sampled samples do not (digest {mine.tokens} vs {[everyone[r].tokens for r in others]}); {fix}"
    )
