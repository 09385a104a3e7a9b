"""The order of an epoch: which samples each planning window holds, in training order.

Two layouts, both pure functions of ``(n, config, epoch)``::

    explicit window (or the whole epoch)    order = shuffle(seed, epoch); window w = order[w*W : (w+1)*W]
    auto window (window=None, large data)   chunks = shuffle(seed) cut every W samples, the same every epoch;
                                            epoch e trains the chunks in order shuffle(seed, e), each chunk's
                                            samples reshuffled with (seed, e, chunk)

The auto layout keeps what ``window=None`` promises for the whole epoch: with a sort-based packer (or
dynamic or padded batching) a window's microbatch count depends only on which samples it holds, so
the count per epoch is constant and a sampler counts the chunks once, not every epoch. Orders are
``uint32`` (4 bytes a sample) below 2^32 samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lit_seqpack.planning.plan import PlanConfig

__all__ = ["AUTO_WINDOW_MIN", "AUTO_WINDOW_STEPS", "WindowOrder", "auto_window", "shuffled"]

AUTO_WINDOW_MIN = 1 << 21  # up to this many samples, window=None plans the whole epoch at once
AUTO_WINDOW_STEPS = 64  # an auto window holds at least this many optimizer steps of samples


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


class WindowOrder:
    """The samples of every window of one epoch, in order (see the module docstring).

    Args:
        num_samples: samples in the dataset.
        config: the plan configuration (``window``, ``seed``, ``shuffle``).
        epoch: the epoch.
        window: samples per window (the resolved one).
        partition: the epoch-independent chunking of the auto layout (``partition_for``), or ``None``
            for the explicit layout.
    """

    def __init__(
        self, num_samples: int, config: PlanConfig, epoch: int, window: int, partition: np.ndarray | None = None
    ) -> None:
        self.num_samples, self.window, self._config, self._epoch = num_samples, window, config, epoch
        self.num_windows = -(-num_samples // window)
        self._fixed = partition is not None and self.num_windows > 1
        if self._fixed:
            self._base = partition
            count = self.num_windows
            self._chunks = shuffled(count, [config.seed, epoch, 5]) if config.shuffle else np.arange(count)
        else:
            self._base = shuffled(num_samples, [config.seed, epoch, 1]) if config.shuffle else None
            self._chunks = None

    @staticmethod
    def partition_for(num_samples: int, config: PlanConfig, window: int) -> np.ndarray | None:
        """The chunking of the auto layout (``None`` when the explicit layout applies)."""
        if config.window is not None or num_samples <= window or not config.shuffle:
            return None  # unshuffled, both layouts train 0, 1, 2, ... in windows of `window`
        return shuffled(num_samples, [config.seed, 4])

    def chunk(self, w: int) -> int:
        """The chunk that window ``w`` trains (``w`` itself in the explicit layout)."""
        return int(self._chunks[w]) if self._fixed else w

    @property
    def counts_are_epoch_independent(self) -> bool:
        """Whether a chunk's samples are the same every epoch (the auto layout)."""
        return self._fixed

    def positions(self, w: int) -> np.ndarray:
        """Dataset indices of window ``w``, in order (``uint32`` below 2^32 samples, ``int64`` otherwise)."""
        c = self.chunk(w)
        lo, hi = c * self.window, min(self.num_samples, (c + 1) * self.window)
        if self._base is None:
            return np.arange(lo, hi, dtype=np.uint32 if hi < 1 << 32 else np.int64)
        positions = self._base[lo:hi]
        if self._fixed and self._config.shuffle:
            positions = positions[np.random.default_rng([self._config.seed, self._epoch, c, 6]).permutation(hi - lo)]
        return positions
