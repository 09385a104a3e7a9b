"""NeMo-RL's ``BatchedDataDict.shard_by_batch_size(shards, batch_size, sequence_packing_args=...)``, re-implemented.

The baseline of ``bench_rl.py``: the planning half of that method, written from its algorithm (NeMo-RL
``nemo_rl/distributed/batched_data_dict.py`` and ``nemo_rl/data/packing/algorithms.py``), statement for statement
where it matters for time, without its data movement (``select_indices`` / ``from_batches`` of every tensor of the
batch, which lit_seqpack leaves to the collators), so the figure is a lower bound of NeMo-RL's cost:

- the rollout is cut into chunks of ``batch_size`` samples (one optimizer step each);
- each chunk's lengths are read one ``.item()`` at a time and padded to ``sequence_length_pad_multiple``;
- each chunk is packed by the chosen packer (pure Python, ``min_bin_count=shards``, ``bin_count_multiple=shards``:
  extra bins are made by moving one sequence at a time from the fullest-counted bins);
- bin ``b`` goes to shard ``b % shards`` (round-robin), with each shard's micro-batch index ranges and token sums.

Only ``modified_first_fit_decreasing`` (NeMo-RL's default) and ``first_fit_decreasing`` are re-implemented.
"""

from __future__ import annotations

from bisect import bisect

import torch

__all__ = ["nemo_rl_shard"]


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """(length, index) pairs sorted in decreasing order, each into the first bin with room (a linear scan)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for length, index in sorted(((n, i) for i, n in enumerate(lengths)), reverse=True):
        for b, free in enumerate(room):
            if free >= length:
                bins[b].append(index)
                room[b] -= length
                break
        else:
            bins.append([index])
            room.append(capacity - length)
    return bins


def _modified_first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's MFFD as NeMo-RL runs it: bins of (index, size) pairs whose fill is re-summed on demand."""
    large, medium, small, tiny = [], [], [], []
    for item in enumerate(lengths):
        size = item[1]
        (
            large if size > capacity / 2 else medium if size > capacity / 3 else small if size > capacity / 6 else tiny
        ).append(item)
    large.sort(key=lambda x: x[1], reverse=True)
    medium.sort(key=lambda x: x[1], reverse=True)
    small.sort(key=lambda x: x[1])
    tiny.sort(key=lambda x: x[1])
    bins = [[item] for item in large]
    for b in bins:  # one medium item per large bin, the first that fits
        free = capacity - sum(s for _, s in b)
        for k, (_, size) in enumerate(medium):
            if size <= free:
                b.append(medium.pop(k))
                break
    for b in reversed(bins):  # two small items into bins without a medium one
        if any(capacity / 3 < s <= capacity / 2 for _, s in b) or len(small) < 2:
            continue
        free = capacity - sum(s for _, s in b)
        if small[0][1] + small[1][1] > free:
            continue
        first = small.pop(0)
        second = next((j for j in range(len(small) - 1, -1, -1) if small[j][1] <= free - first[1]), None)
        if second is not None:
            b.extend([first, small.pop(second)])
    rest = sorted(medium + small + tiny, key=lambda x: x[1], reverse=True)
    for b in bins:  # fill each bin with the largest remaining items that fit
        while rest:
            free = capacity - sum(s for _, s in b)
            if free < rest[-1][1]:
                break
            chosen = next((k for k, (_, s) in enumerate(rest) if s <= free), None)
            if chosen is None:
                break
            b.append(rest.pop(chosen))
    extra: list[list[tuple[int, int]]] = [[]]  # leftovers: into the emptiest bin, bins kept sorted by fill
    fills = [0]
    for item in sorted(rest, key=lambda x: x[1], reverse=True):
        if item[1] <= capacity - fills[0]:
            target, fill = extra.pop(0), fills.pop(0)
        else:
            target, fill = [], 0
        target.append(item)
        fill += item[1]
        where = bisect(fills, fill)
        extra.insert(where, target)
        fills.insert(where, fill)
    bins.extend(extra)
    return [[i for i, _ in b] for b in bins]


PACKERS = {
    "modified_first_fit_decreasing": _modified_first_fit_decreasing,
    "first_fit_decreasing": _first_fit_decreasing,
}


def _adjust_bin_count(bins: list[list[int]], minimum: int, multiple: int) -> list[list[int]]:
    """At least ``minimum`` bins, a multiple of ``multiple``: move one sequence at a time from the bins holding the
    most sequences (each keeps one) into new bins."""
    target = max(len(bins), minimum)
    target += (-target) % multiple
    if target == len(bins):
        return bins
    if sum(len(b) for b in bins) < target:
        raise ValueError(f"cannot make {target} bins of {sum(len(b) for b in bins)} sequences")
    adjusted = [list(b) for b in bins] + [[] for _ in range(target - len(bins))]
    by_count = sorted(((len(b), i) for i, b in enumerate(adjusted[: len(bins)])), reverse=True)
    source = 0
    for new in range(len(bins), target):
        while len(adjusted[by_count[source][1]]) <= 1:
            source += 1
        adjusted[new].append(adjusted[by_count[source][1]].pop())
    return adjusted


def nemo_rl_shard(
    input_lengths: torch.Tensor,
    shards: int,
    max_tokens: int,
    *,
    batch_size: int | None = None,
    algorithm: str = "modified_first_fit_decreasing",
    pad_multiple: int = 1,
) -> tuple[list[list[list[int]]], list[list[list[list[int]]]], list[list[list[int]]]]:
    """Per shard, per chunk (step): the sample indices of each micro-batch, their index ranges and token sums.

    Args:
        input_lengths: ``[N]`` sequence lengths (a tensor, as NeMo-RL's batch holds them).
        shards: data-parallel ranks.
        max_tokens: ``max_tokens_per_microbatch``.
        batch_size: samples per chunk (an optimizer step); ``None``: the whole rollout.
        algorithm: the packer.
        pad_multiple: ``sequence_length_pad_multiple``.
    """
    total = int(input_lengths.shape[0])
    batch_size = batch_size or total
    if total % batch_size or batch_size % shards:
        raise ValueError(f"{total} samples, batch_size {batch_size}, {shards} shards do not divide")

    def padded(n: int) -> int:
        return (n + pad_multiple - 1) // pad_multiple * pad_multiple

    chunk_bins = []
    for chunk in range(total // batch_size):
        start = chunk * batch_size
        seqlens = [padded(n.item()) for n in input_lengths[start : start + batch_size]]
        chunk_bins.append(_adjust_bin_count(PACKERS[algorithm](seqlens, max_tokens), shards, shards))
    samples: list[list[list[int]]] = [[] for _ in range(shards)]
    ranges: list[list[list[list[int]]]] = [[] for _ in range(shards)]
    tokens: list[list[list[int]]] = [[] for _ in range(shards)]
    for chunk, bins in enumerate(chunk_bins):
        chunk_ranges: list[list[list[int]]] = [[] for _ in range(shards)]
        chunk_tokens: list[list[int]] = [[] for _ in range(shards)]
        for b, members in enumerate(bins):
            shard = b % shards
            indices = [i + chunk * batch_size for i in members]
            samples[shard].append(indices)
            chunk_tokens[shard].append(sum(padded(input_lengths[i].item()) for i in indices))
            previous = chunk_ranges[shard][-1][1] if chunk_ranges[shard] else 0
            chunk_ranges[shard].append([previous, previous + len(members)])
        for shard in range(shards):
            ranges[shard].append(chunk_ranges[shard])
            tokens[shard].append(chunk_tokens[shard])
    return samples, ranges, tokens
