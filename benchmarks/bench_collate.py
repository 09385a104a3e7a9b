"""Collate time per packed row: ``PackedCollator`` (numpy index arithmetic) against the former torch version.

The former collator built ``position_ids`` (and, with per-document padding, the scatter index) with
``torch.repeat_interleave``, whose CPU kernel splits its work at grain size 1 and wakes every torch thread on each
call (and ``index_put_`` does the same); :class:`LegacyPackedCollator` keeps that code as the baseline (here
only). Each row packs lognormal documents
(median ``--median``, clipped to [2, ``--max-tokens``]) up to ``--max-tokens`` tokens; the table gives the median
over ``--repeats`` runs of the time per row, with 1 and 2 torch threads, for a plain row and for a row of
documents padded to a multiple of 8 (context parallelism).

    .venv/bin/python benchmarks/bench_collate.py
    .venv/bin/python benchmarks/bench_collate.py --rows 50 --max-tokens 8192 --threads 1 2 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lit_seqpack._checks import round_up
from lit_seqpack.batch import IGNORE_INDEX
from lit_seqpack.data.batching.collate import PackedCollator, _scalars


class LegacyPackedCollator(PackedCollator):
    """``PackedCollator`` with its former layout code (torch ``repeat_interleave`` and ``index_put_``): the baseline.

    Reading and validating the samples is shared; only the index arithmetic of :meth:`_layout` differs (no
    declared fields here).
    """

    def _layout(self, docs, ids, labels, fields, meta, dummy):  # noqa: ANN001, ANN202 - the former code, as it was
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        padded = -(-lengths // (self.pad_document_to_multiple_of or 1)) * (self.pad_document_to_multiple_of or 1)
        body = int(padded.sum())
        total = dummy if dummy is not None else round_up(body, self.pad_to_multiple_of)
        segments = np.append(padded, total - body) if total > body else padded
        cu_seqlens = np.concatenate([[0], np.cumsum(segments)])
        starts = torch.from_numpy(cu_seqlens[: len(docs)])
        input_ids = torch.full((total,), self.pad_token_id, dtype=torch.int64)
        out_labels = torch.full((total,), IGNORE_INDEX, dtype=torch.int64)
        if self.pad_document_to_multiple_of is None:
            input_ids[:body], out_labels[:body] = ids, labels
        else:
            real_starts = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(docs) else lengths)
            dest = torch.arange(len(ids)) + torch.repeat_interleave(starts - real_starts, torch.from_numpy(lengths))
            input_ids[dest], out_labels[dest] = ids, labels
        out_labels[starts] = IGNORE_INDEX
        position_ids = torch.arange(total) - torch.repeat_interleave(
            torch.from_numpy(cu_seqlens[:-1]), torch.from_numpy(segments)
        )
        batch = {
            "input_ids": input_ids[None],
            "labels": out_labels[None],
            "position_ids": position_ids[None],
            "cu_seqlens": torch.from_numpy(cu_seqlens).to(torch.int32),
            "max_seqlen": int(segments.max()),
        }
        loss = int((out_labels != IGNORE_INDEX).sum())
        stats = _scalars(meta, documents=len(docs), real=len(ids), total=total, loss=loss, is_empty=dummy is not None)
        return batch | stats


def _rows(count: int, max_tokens: int, median: float, seed: int) -> list[list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        row, used = [], 0
        while True:
            n = int(np.clip(round(rng.lognormal(np.log(median), 1.0)), 2, max_tokens))
            if used + n > max_tokens:
                break
            row.append({"input_ids": rng.integers(1, 32000, size=n).tolist()})
            used += n
        rows.append(row or [{"input_ids": [1, 2]}])
    return rows


def _ms_per_row(
    collate: Callable[[list[dict[str, Any]]], Any], rows: list[list[dict[str, Any]]], repeats: int
) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for row in rows:
            collate(row)
        times.append((time.perf_counter() - start) / len(rows))
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = _rows(args.rows, args.max_tokens, args.median, args.seed)
    documents = sum(map(len, rows)) / len(rows)
    print(f"{args.rows} packed rows of <= {args.max_tokens} tokens, {documents:.1f} documents a row on average\n")
    print("| layout | torch threads | before (torch indexing) ms/row | after (numpy) ms/row | speed-up |")
    print("|---|---:|---:|---:|---:|")
    previous = torch.get_num_threads()
    try:
        for multiple in (None, 8):
            collator = PackedCollator(pad_document_to_multiple_of=multiple)
            legacy_collator = LegacyPackedCollator(pad_document_to_multiple_of=multiple)
            for row in rows[:3]:  # the baseline is the same layout
                old, new = legacy_collator(row), collator(row)
                assert all(torch.equal(old[key], new[key]) for key in ("input_ids", "labels", "position_ids"))
            for threads in args.threads:
                torch.set_num_threads(threads)
                legacy = _ms_per_row(legacy_collator, rows, args.repeats)
                now = _ms_per_row(collator, rows, args.repeats)
                layout = "packed" if multiple is None else f"per-document pad {multiple}"
                print(f"| {layout} | {threads} | {legacy:.3f} | {now:.3f} | {legacy / now:.1f}x |")
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    main()
