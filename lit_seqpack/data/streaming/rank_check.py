"""The cross-rank check of a stream: every rank must read the same samples, or training stops on every rank.

Ranks plan the windows of a stream without communicating (:mod:`~lit_seqpack.data.streaming.dataset`), which is
only right when they all read the same stream. Ranks reading different shards, file versions or preprocessing with
the same lengths would train a wrong mixture of samples without any error, and ranks whose streams differ only in
the tail (a file appended while training) would run different numbers of microbatches and wait for each other
forever. So each window carries a :class:`WindowDigest` (computed where the window is planned, in the DataLoader
worker), and the loader compares it across ranks with one ``all_gather_object`` in the main process (collectives
cannot run in a worker) at the first batch of every window, and compares the end of the stream (:func:`stream_end`:
windows and samples read, the last window's digest) when the iteration runs out. A rank with an extra window meets
the other ranks' end in the same collective, so every collective runs the same number of times on every rank until
the first difference, and every rank sees the same gathered list: every rank raises together, no rank waits.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch.distributed as dist

from lit_seqpack._hashing import content_digest
from lit_seqpack.data.streaming.buffer import StreamWindow

__all__ = ["WindowDigest", "check_ranks_agree", "stream_end", "window_digest"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WindowDigest:
    """What identifies a window's contents on one rank, or (``ended``) the end of its stream.

    Args:
        epoch: the epoch the window belongs to.
        window: the window's number in the epoch (at the end: the windows read in the epoch).
        first_sample: the stream number of its first sample (named in the error).
        samples_read: the stream samples read up to the end of the window (at the end: in the epoch).
        lengths: digest of the lengths and loss tokens of its samples (``None``: content check off).
        tokens: digest of the tokens of a few of its samples (``None``: content check off).
        ended: this marks the end of the rank's stream, after the window before ``window``.
    """

    epoch: int
    window: int
    first_sample: int
    samples_read: int | None = None
    lengths: str | None = None
    tokens: str | None = None
    ended: bool = False

    def where(self) -> str:
        """The window (or the end) in words, for an error."""
        if self.ended:
            return (
                f"its stream ended after {self.window} windows of epoch {self.epoch}, {self.samples_read} samples read"
            )
        read = (
            "" if self.samples_read is None else f", read stream samples {self.first_sample} to {self.samples_read - 1}"
        )
        return f"window {self.window} of epoch {self.epoch}{read}"


def distributed() -> bool:
    """Whether ``torch.distributed`` is available and initialised."""
    return dist.is_available() and dist.is_initialized()


def window_digest(window: StreamWindow, *, epoch: int, samples: int, seed: int = 0) -> WindowDigest:
    """The digest of ``window``: all its lengths and loss tokens, and the tokens of ``samples`` of its samples.

    Args:
        window: a planned window.
        epoch: its epoch.
        samples: samples whose tokens are hashed (:func:`~lit_seqpack._hashing.sampled_indices`); 0: no content
            digest (the window's numbers are still compared, so a rank with another tail never hangs).
        seed: picks those samples.
    """
    if not samples:
        return WindowDigest(
            epoch=epoch, window=window.index, first_sample=window.first_sample, samples_read=window.samples_read
        )
    lengths = np.fromiter((len(s["input_ids"]) for s in window.samples), dtype=np.int64, count=len(window.samples))
    digest = hashlib.sha256(lengths.tobytes() + np.asarray(window.loss_tokens, dtype=np.int64).tobytes())
    return WindowDigest(
        epoch=epoch,
        window=window.index,
        first_sample=window.first_sample,
        samples_read=window.samples_read,
        lengths=digest.hexdigest()[:16],
        tokens=content_digest(window.samples, samples, seed),
    )


def stream_end(epoch: int, last: WindowDigest | None) -> WindowDigest:
    """The end of a rank's stream in ``epoch`` after the window ``last`` (``None``: no window with a microbatch).

    Example:
        >>> stream_end(0, WindowDigest(epoch=0, window=2, first_sample=20, samples_read=25)).where()
        'its stream ended after 3 windows of epoch 0, 25 samples read'
    """
    if last is None:
        return WindowDigest(epoch=epoch, window=0, first_sample=0, samples_read=0, ended=True)
    return dataclasses.replace(last, window=last.window + 1, first_sample=last.samples_read or 0, ended=True)


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
    fix = (
        "every rank must read the whole, same stream (same files, shards, order, tokenizer and preprocessing, no "
        "file appended or cut while training; not a stream split by rank such as datasets' split_dataset_by_node: "
        "the loader splits each window's plan)"
    )
    if any(_numbers(o) != _numbers(mine) for o in everyone):
        at = "; ".join(f"rank {r}: {o.where()}" for r, o in enumerate(everyone))
        raise RuntimeError(
            f"rank {rank} reads a different stream than ranks {others}: the ranks are at different points of their "
            f"streams at the same check ({at}); {fix}"
        )
    fix += (
        "; a stream whose samples change between reads (random augmentation) needs the content check off "
        "(content_check_samples=0)"
    )
    where = f"window {mine.window} of epoch {mine.epoch} (from stream sample {mine.first_sample})"
    if any(o.lengths != mine.lengths for o in everyone):
        raise RuntimeError(
            f"rank {rank} reads a different stream than ranks {others}: the lengths of the samples of {where} differ "
            f"(digest {mine.lengths} vs {[everyone[r].lengths for r in others]}); {fix}"
        )
    raise RuntimeError(
        f"rank {rank} reads a different stream than ranks {others}: the lengths of {where} agree but the tokens of "
        f"the sampled samples do not (digest {mine.tokens} vs {[everyone[r].tokens for r in others]}); {fix}"
    )


def _numbers(digest: WindowDigest) -> tuple[int, int, int, int | None, bool]:
    return digest.epoch, digest.window, digest.first_sample, digest.samples_read, digest.ended
