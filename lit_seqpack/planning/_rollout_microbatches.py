"""One rank's share of a rollout step as microbatches: packer bins or sorted token-budget blocks, lock-step count.

A share is the rank's samples, item after item (one sample, or a whole group under ``keep_together``). Under
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

from lit_seqpack.planning.dynamic import dynamic_group_sizes, round_up

if TYPE_CHECKING:
    from lit_seqpack.planning.rollout_config import RolloutPlanConfig

__all__ = ["rank_microbatches"]


def rank_microbatches(
    samples: np.ndarray, item_sizes: np.ndarray, lengths: np.ndarray, config: RolloutPlanConfig, target: int = 0
) -> list[list[int]]:
    """One rank's samples as ``target`` microbatches (as many as needed when 0), fillers included.

    Args:
        samples: the rank's sample indices, item after item.
        item_sizes: the sample count of each item (kept together under ``keep_together="microbatch"``).
        lengths: tokens of every sample of the rollout.
        config: the plan's settings.
        target: the microbatch count to reach (bins are split, then empty fillers added); 0: as many as needed.

    Example:
        >>> from lit_seqpack.planning.rollout_config import RolloutPlanConfig
        >>> config = RolloutPlanConfig(max_tokens=8)
        >>> rank_microbatches(np.array([0, 1, 2]), np.ones(3, int), np.array([5, 4, 3]), config)
        [[0, 2], [1]]
    """
    if samples.size == 0:
        return [[] for _ in range(target)]
    keep = config.keep_together == "microbatch"
    if config.mode == "packing":
        bins = _packed(samples, item_sizes if keep else None, lengths, config, target)
    elif keep:
        bins = _dynamic_units(samples, item_sizes, lengths, config)
    else:
        order = samples[np.argsort(-lengths[samples], kind="stable")]
        sizes = dynamic_group_sizes(
            lengths[order],
            config.max_tokens,
            sequence_length_round=config.sequence_length_round,
            group_count_multiple=max(target, 1),
        )
        bins = _split(order, np.cumsum(sizes[sizes > 0]))
    return bins + [[] for _ in range(max(target - len(bins), 0))]


def _split(flat: np.ndarray, ends: np.ndarray) -> list[list[int]]:
    items, stops = flat.tolist(), ends.tolist()
    return [items[a:b] for a, b in zip([0, *stops[:-1]], stops, strict=True)]


def _packed(
    samples: np.ndarray, item_sizes: np.ndarray | None, lengths: np.ndarray, config: RolloutPlanConfig, target: int
) -> list[list[int]]:
    """Packer bins of single samples, or of whole items (``item_sizes``) each packed as one length."""
    from lit_seqpack.planning.algorithms import get_packer, packing_algorithm

    if item_sizes is None:
        sizes = lengths[samples]
    else:
        starts = np.concatenate(([0], np.cumsum(item_sizes)[:-1]))
        sizes = np.add.reduceat(lengths[samples], starts)
    algorithm = packing_algorithm(config.algorithm)  # a sort-based packer fills a single bin longest first
    if target <= 1 and algorithm.sort_based and int(sizes.sum()) <= config.max_tokens:
        flat, ends = np.argsort(-sizes, kind="stable"), np.array([sizes.size])  # one bin, as the packer fills it
    else:
        packer = get_packer(algorithm.name, config.max_tokens, min_bin_count=min(target, sizes.size))
        flat, ends = packer.pack_flat(sizes)
    if item_sizes is None:
        return _split(samples[flat], ends)
    counts = item_sizes[flat]  # every packed item back to its samples, in bin order
    first = np.repeat(starts[flat] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return _split(samples[first + np.arange(first.size)], np.cumsum(counts)[ends - 1])


def _dynamic_units(
    samples: np.ndarray, item_sizes: np.ndarray, lengths: np.ndarray, config: RolloutPlanConfig
) -> list[list[int]]:
    """Dynamic blocks of whole groups: longest first, a block takes groups while ``rows x padded length`` fits."""
    rows = round_up(lengths, config.sequence_length_round)
    items = _split(samples, np.cumsum(item_sizes))
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
