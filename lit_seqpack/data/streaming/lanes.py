"""Lanes: a rank's share of a stream split again among its DataLoader workers (``stream_split="rank"``).

With ``W = num_workers >= 2``, lane ``k`` is ``share.split(k, W)`` (the share's own split, so the rank's share is the
same whatever ``W``; the lanes are disjoint and hold every sample of the share once). Each worker reads, parses and
plans only its lane, in windows as :func:`~lit_seqpack.data.streaming.buffer.stream_windows` plans them, and sends
ONE DataLoader item per window: the window's collated microbatches and the facts the lock step needs. torch's
DataLoader returns the workers' items in round-robin worker order, skipping workers that have ended (deterministic,
``in_order=True``), so the rank's microbatches are the lanes' windows concatenated in arrival order; the loader gives
each arriving window its rank-level first microbatch and step (running counts) and feeds the lock step with it as
before (:mod:`~lit_seqpack.data.streaming.loader`). A collated microbatch's own ``MicrobatchMeta.step`` counts in
its lane (its worker does not know the rank's count; nothing downstream of a stream reads it): the loader sets the
rank-level ``step_loss_tokens`` of every batch.

A resume (:class:`LaneHistory`) needs each lane's last window record, the lane whose window comes next and the
microbatches of the current window already trained: worker ``k`` then reads lane ``(first + k) % W``, so the lane
read next is read first and the round robin goes on as uninterrupted. The window arrivals depend on ``W``: a resume
with another ``num_workers`` is refused. With ``num_workers`` 0 or 1 the share is one lane, read as before (in the
main process, or in the one worker): those two resume each other's checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from lit_seqpack.data.sources.streams import describe_stream

__all__ = [
    "LaneHistory",
    "LanesStart",
    "lane_count",
    "lane_source",
    "merged_overlong",
    "splits_by_worker",
    "splits_into_lanes",
]

_SHOWN = 5  # over-long samples a report lists (as OverlongCounter)


def splits_into_lanes(source: Any) -> bool:
    """Whether the rank's share ``source`` can be split into lanes (it has ``split(index, count)``); a stream without
    it falls back to every worker reading the whole share and collating every ``W``-th microbatch.

    Example:
        >>> from lit_seqpack.data.sources import GeneratorStream
        >>> splits_into_lanes(GeneratorStream(lambda: iter(()))), splits_into_lanes(object())
        (True, False)
    """
    return callable(getattr(source, "split", None))


def lane_count(share: Any, num_workers: int) -> int:
    """The lanes a rank's ``share`` is read in by ``num_workers`` loader workers: one a worker from 2 workers on, when
    the share can be split (else 0: no lanes, every worker reads the whole share).

    Example:
        >>> from lit_seqpack.data.sources import GeneratorStream
        >>> [lane_count(GeneratorStream(lambda: iter(())), w) for w in (0, 1, 3)], lane_count(object(), 3)
        ([0, 0, 3], 0)
    """
    return num_workers if num_workers > 1 and splits_into_lanes(share) else 0


def lane_source(share: Any, lane: int, lanes: int) -> Any:
    """Lane ``lane`` of ``lanes`` of a rank's ``share`` (``share.split(lane, lanes)``; the share itself for one lane).

    Raises:
        ValueError: naming ``num_workers``, when there are several lanes and the share (or a child of a mixture)
            splits itself among DataLoader workers (a Hugging Face ``IterableDataset`` does, by shard, inside each
            worker), so a lane cannot be read exactly in a worker.
    """
    if lanes == 1:
        return share
    reader = splits_by_worker(share)
    if reader is not None:
        raise ValueError(
            f"stream_split='rank' with num_workers={lanes} splits each rank's share into {lanes} lanes, one a loader "
            f"worker, but {describe_stream(reader)} splits itself among DataLoader workers (by shard) and would read "
            "another part than its lane: set num_workers=0"
        )
    try:
        return share.split(lane, lanes)
    except ValueError as err:
        raise ValueError(
            f"stream_split='rank' with num_workers={lanes} splits each rank's share into {lanes} lanes, one a loader "
            f"worker: {err}; set num_workers=0 or 1"
        ) from err


def splits_by_worker(source: Any) -> Any:
    """The stream (``source`` or a child of a mixture) that splits itself among DataLoader workers, else ``None``."""
    if getattr(source, "splits_by_worker", False):
        return source
    for child in getattr(source, "sources", None) or ():
        found = splits_by_worker(child)
        if found is not None:
            return found
    return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LanesStart:
    """Where each lane starts an iteration, and which lane the first worker reads.

    Args:
        lanes: per lane ``{"record": window record or None, "skip": microbatches of that window already trained,
            "overlong": the lane's over-long counts so far}``; a record re-reads its window (plans are deterministic)
            and yields the microbatches after ``skip`` (none when ``skip`` covers the window: the lane goes on with its
            next window).
        first: the lane worker 0 reads (worker ``k`` reads lane ``(first + k) % len(lanes)``).
        microbatch: the rank's microbatch number of the first window that arrives (at its microbatch 0).
        step: the rank's step number of that window's first step.
    """

    lanes: tuple[Mapping[str, Any], ...]
    first: int = 0
    microbatch: int = 0
    step: int = 0

    @classmethod
    def fresh(cls, lanes: int) -> LanesStart:
        """Every lane from its start."""
        return cls(lanes=tuple(_done(None) for _ in range(lanes)))

    def lane_of(self, worker: int) -> int:
        """The lane that ``worker`` reads."""
        return (self.first + worker) % len(self.lanes)


class LaneHistory:
    """The windows that arrived from the lanes this epoch, in arrival order, with their rank-level numbers.

    Only the last ``kept`` arrivals are kept; the last one of each lane before them is kept in :attr:`base`, so the
    state stays bounded (``W + kept`` window records).

    Args:
        lanes: the number of lanes.
        kept: arrivals kept in full (a resume point must fall within them).
    """

    def __init__(self, lanes: int, kept: int) -> None:
        self.lanes = lanes
        self.base: list[dict[str, Any] | None] = [None] * lanes
        self.arrivals: deque[dict[str, Any]] = deque(maxlen=kept)

    def arrive(self, lane: int, record: Mapping[str, Any], *, microbatch: int, step: int, item: Mapping[str, Any]):
        """Record a window of ``lane`` that starts at the rank's ``microbatch`` and ``step``."""
        entry = {
            "lane": lane,
            "record": dict(record),
            "first_microbatch": microbatch,
            "first_step": step,
            "microbatches": int(item["microbatches"]),
            "steps": len(item["step_loss_tokens"]),
            "overlong_after": item["overlong_after"],
        }
        while self.arrivals and self.arrivals[-1]["first_microbatch"] >= microbatch:  # read ahead before a resume
            self.arrivals.pop()
        if len(self.arrivals) == self.arrivals.maxlen:
            oldest = self.arrivals[0]
            self.base[oldest["lane"]] = oldest
        self.arrivals.append(entry)

    def reset(self) -> None:
        """Forget every arrival (a new epoch)."""
        self.base = [None] * self.lanes
        self.arrivals.clear()

    def state(self) -> dict[str, Any]:
        """The history as a checkpoint holds it."""
        return {"base": list(self.base), "arrivals": list(self.arrivals)}

    def load(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state`."""
        self.base = list(state["base"])
        self.arrivals = deque(state["arrivals"], maxlen=self.arrivals.maxlen)

    def start_at(self, position: int) -> LanesStart:
        """Where each lane starts so that the rank's microbatches continue at ``position`` exactly.

        Raises:
            RuntimeError: ``position`` is before the arrivals kept (the state was written too far ahead).
        """
        if position == 0:
            return LanesStart.fresh(self.lanes)
        arrivals = list(self.arrivals)
        at = max((i for i, e in enumerate(arrivals) if e["first_microbatch"] <= position), default=None)
        if at is None:
            if arrivals:
                raise RuntimeError(
                    f"cannot resume the stream's lanes exactly at microbatch {position}: the loader state holds no "
                    f"window starting at or before it (written more than {len(arrivals)} windows ahead of the loop)"
                )
            return LanesStart.fresh(self.lanes)  # the rank's share was empty: read it again (it yields nothing)
        lanes = [_done(entry) for entry in self.base]
        for entry in arrivals[:at]:
            lanes[entry["lane"]] = _done(entry)
        current = arrivals[at]
        lane, skip = current["lane"], position - current["first_microbatch"]
        if skip < current["microbatches"]:  # inside the current window: its lane is read first, from ``skip``
            lanes[lane] = {"record": current["record"], "skip": skip, "overlong": current["record"]["overlong_before"]}
            first, microbatch, step = lane, current["first_microbatch"], current["first_step"]
        else:  # at its end (the rank's last window so far): the next lane is read first
            lanes[lane] = _done(current)
            first = (lane + 1) % self.lanes
            microbatch = current["first_microbatch"] + current["microbatches"]
            step = current["first_step"] + current["steps"]
        return LanesStart(lanes=tuple(lanes), first=first, microbatch=microbatch, step=step)


def _done(entry: Mapping[str, Any] | None) -> dict[str, Any]:
    """A lane's start after ``entry`` (its last window that arrived, trained in full; ``None``: the lane's start)."""
    if entry is None:
        return {"record": None, "skip": 0, "overlong": None}
    return {"record": entry["record"], "skip": entry["microbatches"], "overlong": entry["overlong_after"]}


def merged_overlong(states: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """The over-long counts of the lanes read so far, summed (:meth:`~.buffer.OverlongCounter.state`; the samples
    shown are numbered in their lane).

    Example:
        >>> one = {"num_samples": 4, "num_overlong": 1, "tokens_cut": 3, "shown": [[2, 9]]}
        >>> merged_overlong([one, None, one])["num_samples"]
        8
    """
    known = [state for state in states if state is not None]
    if not known:
        return None
    merged: dict[str, Any] = {key: sum(int(s[key]) for s in known) for key in ("num_samples", "num_overlong")}
    merged["tokens_cut"] = sum(int(s["tokens_cut"]) for s in known)
    merged["num_pieces"] = sum(int(s.get("num_pieces", 0)) for s in known)
    merged["shown"] = [list(item) for s in known for item in s["shown"]][:_SHOWN]
    return merged
