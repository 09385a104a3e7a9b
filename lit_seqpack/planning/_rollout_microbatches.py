"""One rank's share of a rollout step as microbatches: packer bins or sorted token-budget blocks, lock-step count.

The items of a share are lists of sample indices (one sample, or a whole group under ``keep_together``). Under
``keep_together="microbatch"`` packing hands every group to the packers of :mod:`lit_seqpack.planning.algorithms` as
one length (so it lands in one bin) and dynamic mode fills blocks with whole groups; otherwise (``None``, or
``"rank"``, whose groups were already dealt whole to this rank) the samples are packed one by one, so a group may
span several microbatches of its rank. The packers reach the target count with their ``min_bin_count`` split;
dynamic mode sorts samples longest first and cuts :func:`~lit_seqpack.planning.dynamic.dynamic_group_sizes`
blocks. Empty lists complete the count (zero-weight lock-step fillers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lit_seqpack.planning._windows import DEFAULT_ALGORITHM
from lit_seqpack.planning.dynamic import dynamic_group_sizes, round_up

if TYPE_CHECKING:
    from lit_seqpack.planning.rollout_config import RolloutPlanConfig

__all__ = ["rank_microbatches"]


def rank_microbatches(
    items: list[list[int]], lengths: np.ndarray, config: RolloutPlanConfig, target: int = 0
) -> list[list[int]]:
    """One rank's items as ``target`` microbatches (as many as needed when 0), fillers included.

    Example:
        >>> from lit_seqpack.planning.rollout_config import RolloutPlanConfig
        >>> rank_microbatches([[0], [1], [2]], np.array([5, 4, 3]), RolloutPlanConfig(max_tokens=8), target=3)
        [[0], [1], [2]]
    """
    if not items:
        return [[] for _ in range(target)]
    keep = config.keep_together == "microbatch"
    if not keep:  # a rank's groups are already whole on it: its samples are packed one by one
        items = [[i] for item in items for i in item]
    if config.mode == "packing":
        from lit_seqpack.planning.algorithms import get_packer

        sizes = np.array([lengths[item].sum() for item in items], dtype=np.int64)
        packer = get_packer(
            config.algorithm or DEFAULT_ALGORITHM, config.max_tokens, min_bin_count=min(target, len(items))
        )
        bins = [[i for j in b for i in items[j]] for b in packer.pack(sizes)]
    elif keep:
        bins = _dynamic_units(items, lengths, config)
    else:
        flat = np.array([item[0] for item in items], dtype=np.int64)
        order = flat[np.argsort(-lengths[flat], kind="stable")]
        sizes = dynamic_group_sizes(
            lengths[order],
            config.max_tokens,
            sequence_length_round=config.sequence_length_round,
            group_count_multiple=max(target, 1),
        )
        bounds = np.concatenate(([0], np.cumsum(sizes)))
        bins = [order[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        bins = [b for b in bins if b]
    return bins + [[] for _ in range(max(target - len(bins), 0))]


def _dynamic_units(items: list[list[int]], lengths: np.ndarray, config: RolloutPlanConfig) -> list[list[int]]:
    """Dynamic blocks of whole groups: longest first, a block takes groups while ``rows x padded length`` fits."""
    rows = round_up(lengths, config.sequence_length_round)
    order = sorted(range(len(items)), key=lambda j: -int(rows[items[j]].max()))
    blocks: list[list[int]] = []
    width = count = 0
    for j in order:
        top = int(rows[items[j]].max())
        if blocks and (count + len(items[j])) * max(width, top) <= config.max_tokens:
            blocks[-1].extend(items[j])
            count += len(items[j])
            width = max(width, top)
        else:
            blocks.append(list(items[j]))
            count, width = len(items[j]), top
    return blocks
