"""The order of an epoch: which samples each planning window holds, in training order.

Two sample orders, both pure functions of ``(n, config, epoch)``::

    explicit window (or the whole epoch)    order = shuffle(seed, epoch); window w = order[w*W : (w+1)*W]
    auto window (window=None, large data)   chunks = blocks of B consecutive samples in the order
                                            shuffle(seed), cut every W samples, the same every epoch;
                                            epoch e trains the chunks in order shuffle(seed, e), each chunk's
                                            samples reshuffled with (seed, e, chunk)

The auto order keeps what ``window=None`` promises for the whole epoch: with a sort-based packer (or
dynamic or padded batching) a window's microbatch count depends only on which samples it holds, so
the count per epoch is constant and a sampler counts the chunks once, not every epoch. The chunks are
made of blocks (:class:`ChunkPartition`: at least 2048 blocks a chunk, ``B`` at most 1024 samples) so
that no rank shuffles the whole dataset: a chunk's samples come from its blocks in O(W), the partition
is one small permutation of the blocks, and counting a chunk reads its lengths block by block. Orders
are ``uint32`` (4 bytes a sample) below 2^32 samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lit_seqpack.planning.config import PlanConfig

__all__ = [
    "AUTO_WINDOW_MIN",
    "AUTO_WINDOW_STEPS",
    "PARTITION_BLOCK_MAX",
    "ChunkPartition",
    "WindowOrder",
    "auto_window",
    "shuffled",
]

AUTO_WINDOW_MIN = 1 << 21  # up to this many samples, window=None plans the whole epoch at once
AUTO_WINDOW_STEPS = 64  # an auto window holds at least this many optimizer steps of samples
PARTITION_BLOCK_MAX = 1024  # the auto order moves samples in blocks of at most this many consecutive ones
PARTITION_BLOCKS_PER_CHUNK = 2048  # ... and at least this many blocks make one chunk


def shuffled(n: int, entropy: list[int]) -> np.ndarray:
    """``default_rng(entropy).permutation(n)`` (the same draws), as ``uint32`` when ``n < 2**32``.

    Example:
        >>> bool((shuffled(1000, [0, 1]) == np.random.default_rng([0, 1]).permutation(1000)).all())
        True
    """
    order = np.arange(n, dtype=np.uint32 if n < 1 << 32 else np.int64)
    np.random.default_rng(entropy).shuffle(order)
    return order


def auto_window(config: PlanConfig, num_samples: int, num_tokens: int) -> int:
    """The window of ``window=None``: the whole epoch up to ``max(AUTO_WINDOW_MIN, 64 steps)`` samples.

    A step's worth of samples is ``world_size x accumulate_grad_batches`` microbatches of about
    ``max_tokens / mean length`` samples (padded: ``batch_size``). Rounding a window up to whole steps
    splits at most one step's worth of bins in ``AUTO_WINDOW_STEPS`` (< 1.6% more microbatches, about
    half on average); planning memory is about 80 bytes per sample of a window (``bench_scale.py``).
    """
    if config.mode == "padded":
        per_microbatch = config.batch_size
    else:
        per_microbatch = max(1, round(config.max_tokens * num_samples / max(num_tokens, 1)))
    window = max(AUTO_WINDOW_MIN, AUTO_WINDOW_STEPS * config.slots_per_step * per_microbatch)
    return max(num_samples, 1) if num_samples <= window else window


class ChunkPartition:
    """The epoch-independent chunks of the auto order: blocks of consecutive samples, shuffled once.

    Blocks hold ``block = clip(window // 2048, 1, 1024)`` consecutive samples (the last one fewer), laid
    out in the order ``shuffle(seed)`` of the blocks; chunk ``c`` is samples ``c*window .. (c+1)*window - 1``
    of that order. Memory is one entry per block, and a chunk's samples come in O(window).

    Args:
        num_samples: samples in the dataset.
        window: samples per chunk.
        seed: the plan's seed.

    Example:
        >>> part = ChunkPartition(10, window=4, seed=0)
        >>> sorted(int(i) for c in range(part.num_chunks) for i in part.members(c)) == list(range(10))
        True
    """

    def __init__(self, num_samples: int, window: int, seed: int) -> None:
        self.num_samples, self.window = num_samples, window
        self.block = int(min(PARTITION_BLOCK_MAX, max(1, window // PARTITION_BLOCKS_PER_CHUNK)))
        self.num_chunks = -(-num_samples // window)
        count = -(-num_samples // self.block)
        self.block_order = shuffled(count, [seed, 4])
        sizes = np.full(count, self.block, dtype=np.int64)
        sizes[-1] = num_samples - (count - 1) * self.block
        self._starts = np.concatenate(
            ([0], np.cumsum(sizes[self.block_order]))
        )  # offset of each block in the epoch order

    def members(self, c: int) -> np.ndarray:
        """Dataset indices of chunk ``c`` in epoch order (``uint32`` below 2^32 samples, else ``int64``)."""
        lo, hi = c * self.window, min(self.num_samples, (c + 1) * self.window)
        out = np.empty(hi - lo, dtype=np.uint32 if self.num_samples < 1 << 32 else np.int64)
        first = int(np.searchsorted(self._starts, lo, side="right")) - 1
        k, filled = first, 0
        while filled < out.size:
            start = int(self.block_order[k]) * self.block + (lo - int(self._starts[k]) if k == first else 0)
            take = min(out.size - filled, int(self._starts[k + 1]) - max(lo, int(self._starts[k])))
            out[filled : filled + take] = np.arange(start, start + take, dtype=out.dtype)
            filled, k = filled + take, k + 1
        return out


class WindowOrder:
    """The samples of every window of one epoch, in order (see the module docstring).

    Args:
        num_samples: samples in the dataset.
        config: the plan configuration (``window``, ``seed``, ``shuffle``).
        epoch: the epoch.
        window: samples per window (the resolved one).
        partition: the epoch-independent chunking of the auto order (``partition_for``), or ``None``
            for the explicit order.
    """

    def __init__(
        self, num_samples: int, config: PlanConfig, epoch: int, window: int, partition: ChunkPartition | None = None
    ) -> None:
        self.num_samples, self.window, self._config, self._epoch = num_samples, window, config, epoch
        self.num_windows = -(-num_samples // window)
        self._partition = partition if partition is not None and self.num_windows > 1 else None
        self._base = self._chunks = None
        if self._partition is not None:
            count = self.num_windows
            self._chunks = shuffled(count, [config.seed, epoch, 5]) if config.shuffle else np.arange(count)
        elif config.shuffle:
            self._base = shuffled(num_samples, [config.seed, epoch, 1])

    @staticmethod
    def partition_for(num_samples: int, config: PlanConfig, window: int) -> ChunkPartition | None:
        """The chunking of the auto order (``None`` when the explicit order applies)."""
        if config.window is not None or num_samples <= window or not config.shuffle:
            return None  # unshuffled, both orders train 0, 1, 2, ... in windows of `window`
        return ChunkPartition(num_samples, window, config.seed)

    def chunk(self, w: int) -> int:
        """The chunk that window ``w`` trains (``w`` itself in the explicit order)."""
        return int(self._chunks[w]) if self._partition is not None else w

    @property
    def counts_are_epoch_independent(self) -> bool:
        """Whether a chunk's samples are the same every epoch (the auto order)."""
        return self._partition is not None

    def members(self, w: int) -> np.ndarray:
        """Dataset indices of window ``w`` in an epoch-independent order where there is one (for counting).

        The same samples as :meth:`positions`; only the order may differ, which a sort-based packer,
        dynamic and padded batching do not see when they count.
        """
        if self._partition is not None:
            return self._partition.members(self.chunk(w))
        return self.positions(w)

    def positions(self, w: int) -> np.ndarray:
        """Dataset indices of window ``w``, in order (``uint32`` below 2^32 samples, ``int64`` otherwise)."""
        c = self.chunk(w)
        if self._partition is not None:
            members = self._partition.members(c)
            if self._config.shuffle:  # in place: the order of members[rng.permutation(n)], without its int64 array
                np.random.default_rng([self._config.seed, self._epoch, c, 6]).shuffle(members)
            return members
        lo, hi = c * self.window, min(self.num_samples, (c + 1) * self.window)
        if self._base is None:
            return np.arange(lo, hi, dtype=np.uint32 if hi < 1 << 32 else np.int64)
        return self._base[lo:hi]
