"""Property fuzzing of DESIGN.md's invariants over random lengths, modes, budgets, world sizes and accumulation.

Planner + samplers (every index once per epoch over all ranks, lock-step counts per rank and per step, no
microbatch over budget, exact ``step_loss_tokens``, exact resume), collators (the batch contract), attention and
the reference decoder (packed equals per-document, zero cross-document gradient). CI runs a few examples per
property; ``scripts/fuzz.sh`` runs the long campaign (``HYPOTHESIS_PROFILE=fuzz``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given
from hypothesis import strategies as st

from lit_seqpack import (
    PACKING_ALGORITHMS,
    SeqPackDataModule,
)
from lit_seqpack.data import PlannedDataset
from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.model.attention import varlen_attention
from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder
from tests._samplers import planned_sampler
from tests.reliability.conftest import FUZZ_SETTINGS

MODES = ("packing", "dynamic", "padded")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@st.composite
def plans(draw: st.DrawFn, *, min_length: int = 0) -> dict:
    """A random planning problem: lengths, mode, layout and every knob the samplers take."""
    mode = draw(st.sampled_from(list(MODES)))
    # edge values (the shortest allowed, exactly the largest) are drawn often, not only by luck
    lengths = draw(st.lists(st.integers(min_length, 70) | st.sampled_from([min_length, 70]), max_size=120))
    r = draw(st.sampled_from([1, 2, 8]))
    knobs: dict = {
        "num_replicas": draw(st.integers(1, 8)),
        "accumulate_grad_batches": draw(st.integers(1, 4)),
        "seed": draw(st.integers(0, 2**16)),
        "shuffle": draw(st.booleans()),
        "window": draw(st.none() | st.integers(1, 130)),
        "sequence_length_round": r,
        "microbatch_order": draw(st.sampled_from(["largest_first", "packer"])),
        "cost_quadratic": draw(st.sampled_from([0.0, 0.02])),
    }
    if mode == "padded":
        knobs["batch_size"] = draw(st.integers(1, 8))
    else:
        least = _round_up(max(max(lengths, default=1), 1), r)
        knobs["max_tokens"] = least + r * draw(st.integers(0, 12))
    if mode == "packing":
        knobs["algorithm"] = draw(st.sampled_from(PACKING_ALGORITHMS))
    if draw(st.booleans()):
        knobs["loss_tokens"] = [draw(st.integers(0, n)) for n in lengths]
    return {"mode": mode, "lengths": lengths, "knobs": knobs, "epoch": draw(st.integers(0, 3))}


def _samplers(case: dict) -> list:
    world = case["knobs"]["num_replicas"]
    samplers = [planned_sampler(case["mode"], case["lengths"], rank=r, **case["knobs"]) for r in range(world)]
    for sampler in samplers:
        sampler.set_epoch(case["epoch"])
    return samplers


def _check_budget(mode: str, knobs: dict, sizes: list[int]) -> None:
    r = knobs["sequence_length_round"]
    if mode == "packing":
        assert _round_up(sum(sizes), r) <= knobs["max_tokens"]
    elif mode == "dynamic":
        assert len(sizes) * _round_up(max(sizes, default=0), r) <= knobs["max_tokens"]
    else:
        assert len(sizes) <= knobs["batch_size"]


EDGE_CASE = {  # more ranks than samples, lengths equal to the budget, a zero-length sample, a window of 1
    "mode": "packing",
    "lengths": [70, 0, 70],
    "knobs": {
        "num_replicas": 8, "accumulate_grad_batches": 3, "seed": 0, "shuffle": True, "window": 1,
        "sequence_length_round": 2, "microbatch_order": "largest_first", "cost_quadratic": 0.02, "max_tokens": 70,
        "algorithm": "modified_first_fit_decreasing",
    },
    "epoch": 1,
}  # fmt: skip


@FUZZ_SETTINGS
@given(case=plans())
@example(case=EDGE_CASE)
def test_every_index_once_in_lock_step_within_budget_with_exact_step_loss_tokens(case: dict) -> None:
    samplers = _samplers(case)
    per_rank = [list(sampler) for sampler in samplers]
    accumulate, lengths = case["knobs"]["accumulate_grad_batches"], np.asarray(case["lengths"], dtype=np.int64)
    loss = np.asarray(case["knobs"].get("loss_tokens", np.maximum(lengths - 1, 0)), dtype=np.int64)
    counts = {len(mbs) for mbs in per_rank} | {len(sampler) for sampler in samplers}
    assert len(counts) == 1 and counts.pop() % accumulate == 0  # lock-step: same count, whole steps
    flat = sorted(i for mbs in per_rank for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))  # every index exactly once over all ranks
    for position, column in enumerate(zip(*per_rank, strict=True)):
        step = position // accumulate
        step_total = sum(
            int(loss[mb].sum()) for mbs in per_rank for mb in mbs[step * accumulate : (step + 1) * accumulate]
        )
        for mb in column:
            assert (mb.meta.step, mb.meta.step_loss_tokens, mb.meta.is_empty) == (step, step_total, not mb)
            _check_budget(case["mode"], case["knobs"], lengths[mb].tolist())
    stats = samplers[0].plan.stats
    assert stats.num_microbatches == len(samplers) * len(per_rank[0])
    assert stats.num_empty_microbatches == sum(not mb for mbs in per_rank for mb in mbs)


@FUZZ_SETTINGS
@given(case=plans(), cut=st.floats(0.0, 1.0))
def test_a_resume_at_any_cut_yields_exactly_the_rest_and_plans_are_deterministic(case: dict, cut: float) -> None:
    sampler, again = _samplers(case)[0], _samplers(case)[0]
    assert sampler.plan.fingerprint() == again.plan.fingerprint()  # a pure function of its inputs
    full = [list(mb) for mb in sampler]
    k = round(cut * len(full))
    iterator = iter(again)
    for _ in range(k):
        next(iterator)
    state = again.state_dict()
    resumed = planned_sampler(case["mode"], case["lengths"], rank=0, **case["knobs"])
    resumed.load_state_dict(state)
    rest = [list(mb) for mb in resumed]
    if k < len(full) or not full:
        assert rest == full[k:]
    else:  # a finished epoch is saved as the start of the next one
        nxt = planned_sampler(case["mode"], case["lengths"], rank=0, **case["knobs"])
        nxt.set_epoch(case["epoch"] + 1)
        assert rest == [list(mb) for mb in nxt]


@st.composite
def documents(draw: st.DrawFn, lengths: list[int]) -> list[dict]:
    """Samples of the given lengths; some carry labels with masked (-100) prompt positions."""
    samples = []
    for n in lengths:
        ids = draw(st.lists(st.integers(0, 99), min_size=n, max_size=n))
        sample = {"input_ids": ids}
        if draw(st.booleans()):
            prompt = draw(st.integers(0, n))
            sample["labels"] = [-100] * prompt + ids[prompt:]
        samples.append(sample)
    return samples


def _check_packed(batch: dict, docs: list[dict], budget: int | None, r: int, pad_doc: int | None) -> None:
    total = batch["input_ids"].shape[1]
    cu, lengths = batch["cu_seqlens"], [len(d["input_ids"]) for d in docs]
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == total and total % r == 0
    assert budget is None or total <= budget
    segments = torch.diff(cu).tolist()
    assert batch["max_seqlen"] == max(segments)
    labels, positions, ids = batch["labels"][0], batch["position_ids"][0], batch["input_ids"][0]
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        assert positions[start:end].tolist() == list(range(end - start))  # positions restart per segment
    for i, doc in enumerate(docs):
        start, n = int(cu[i]), lengths[i]
        assert pad_doc is None or segments[i] == _round_up(n, pad_doc)
        assert ids[start : start + n].tolist() == doc["input_ids"]
        want = [-100, *doc.get("labels", doc["input_ids"])[1:]]  # -100 at every document start
        assert labels[start : start + n].tolist() == want
        assert (labels[start + n : int(cu[i + 1])] == -100).all()  # per-document padding
    assert (labels[int(cu[len(docs)]) :] == -100).all()  # the padding tail
    assert batch["num_real_tokens"] == sum(lengths) and batch["num_padding_tokens"] == total - sum(lengths)


def _check_padded(batch: dict, docs: list[dict], budget: int | None, r: int) -> None:
    rows, width = batch["input_ids"].shape
    assert rows == len(docs) and width % r == 0 and (budget is None or rows * width <= budget)
    for row, doc in enumerate(docs):
        n = len(doc["input_ids"])
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (width - n)
        assert batch["position_ids"][row].tolist() == list(range(width))
        want = [-100, *doc.get("labels", doc["input_ids"])[1:]] + [-100] * (width - n)
        assert batch["labels"][row].tolist() == want
    assert batch["num_padding_tokens"] == rows * width - batch["num_real_tokens"]


@FUZZ_SETTINGS
@given(case=plans(min_length=1), pad_doc=st.sampled_from([None, 4]), data=st.data())
def test_collated_batches_keep_the_contract_and_sum_to_the_step_loss_tokens(case: dict, pad_doc, data) -> None:
    knobs, mode = case["knobs"], case["mode"]
    docs = data.draw(documents(case["lengths"]))
    lengths = [len(d["input_ids"]) for d in docs]
    knobs["loss_tokens"] = [sum(t != -100 for t in d.get("labels", d["input_ids"])[1:]) for d in docs]
    r, pad_doc = knobs["sequence_length_round"], pad_doc if mode == "packing" else None
    planned = [_round_up(n, pad_doc or 1) for n in lengths]
    if mode != "padded":
        knobs["max_tokens"] = max(knobs["max_tokens"], _round_up(max(planned, default=1), r))
    collate = (
        PackedCollator(pad_to_multiple_of=r, pad_document_to_multiple_of=pad_doc)
        if mode == "packing"
        else PaddedCollator(pad_to_multiple_of=r)
    )
    samplers = [planned_sampler(mode, planned, rank=rank, **knobs) for rank in range(knobs["num_replicas"])]
    dataset = PlannedDataset(docs)
    step_sums: dict[int, int] = {}
    for sampler in samplers:
        for mb in sampler:
            batch = collate(dataset.__getitems__(mb))
            step_sums[mb.meta.step] = step_sums.get(mb.meta.step, 0) + batch["num_loss_tokens"]
            assert batch["step_loss_tokens"] == mb.meta.step_loss_tokens and batch["is_empty"] == (not mb)
            assert batch["num_loss_tokens"] == int((batch["labels"] != -100).sum())
            if not mb:
                assert (batch["labels"] == -100).all()
            elif mode == "packing":
                _check_packed(batch, [docs[i] for i in mb], knobs["max_tokens"], r, pad_doc)
            else:
                _check_padded(batch, [docs[i] for i in mb], knobs.get("max_tokens"), r)
    for sampler in samplers:
        for step, total in enumerate(sampler.plan.step_loss_tokens.tolist()):
            assert step_sums[step] == total  # exact: the step's loss tokens over all ranks


def _per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], causal: bool) -> torch.Tensor:
    """Plain attention over each segment alone (GQA by repeating k/v heads), concatenated."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qd, kd, vd = (x[start:end].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(groups, 0), vd.repeat_interleave(groups, 0)
        scores = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        outs.append((F.softmax(scores, dim=-1) @ vd).transpose(0, 1))
    return torch.cat(outs)


@FUZZ_SETTINGS
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=8),
    tail=st.integers(0, 5),
    kv_heads=st.sampled_from([1, 2]),
    groups=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([2, 4, 8]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_attention_equals_per_document_attention_and_never_leaks(
    lengths: list[int], tail: int, kv_heads: int, groups: int, head_dim: int, causal: bool, seed: int
) -> None:
    segments = lengths + ([tail] if tail else [])
    bounds = np.concatenate([[0], np.cumsum(segments)]).tolist()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(bounds[-1], kv_heads * groups, head_dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(bounds[-1], kv_heads, head_dim, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in "kv"
    )
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    out = varlen_attention(q, k, v, cu_seqlens, max(segments), causal=causal, backend="sdpa")
    torch.testing.assert_close(out, _per_document(q, k, v, bounds, causal), rtol=0, atol=1e-12)
    j = seed % len(lengths)  # the gradient of one document's output reaches no other segment's q, k or v
    out[bounds[j] : bounds[j + 1]].sum().backward()
    outside = torch.ones(bounds[-1], dtype=torch.bool)
    outside[bounds[j] : bounds[j + 1]] = False
    for x in (q, k, v):
        assert not x.grad[outside].any()


@FUZZ_SETTINGS
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=5), tail=st.integers(0, 3), seed=st.integers(0, 99))
def test_the_reference_decoder_on_a_random_packed_row_equals_each_document_alone(
    lengths: list[int], tail: int, seed: int
) -> None:
    torch.manual_seed(seed)
    config = ReferenceConfig(vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32)
    model = ReferenceDecoder(config).double()
    segments = lengths + ([tail] if tail else [])
    ids = torch.randint(0, 32, (1, sum(segments)), requires_grad=False)
    positions = torch.cat([torch.arange(n) for n in segments])[None]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(segments)]), dtype=torch.int32)
    packed = model(ids, position_ids=positions, cu_seqlens=cu_seqlens, max_seqlen=max(segments), attn_backend="sdpa")
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n], attn_backend="sdpa")
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=0, atol=1e-10)
        start += n


class _Layout:
    """What SeqPackDataModule reads from a Trainer: one global rank of a ``world_size``-process run."""

    class _Connector:
        use_distributed_sampler = False

    _accelerator_connector = _Connector()

    def __init__(self, world_size: int, global_rank: int, accumulate: int) -> None:
        from types import SimpleNamespace

        self.world_size, self.global_rank, self.accumulate_grad_batches = world_size, global_rank, accumulate
        self.fit_loop = SimpleNamespace(epoch_progress=SimpleNamespace(current=SimpleNamespace(processed=0)))


def _original_indices(view: object) -> list[int]:
    return [view[i]["index"] for i in range(len(view))]


@FUZZ_SETTINGS
@given(
    # samples of 2+ tokens: a training split of one-token samples has no loss token and is refused at setup
    # (tests/data/test_datamodule.py::test_a_training_split_without_any_loss_token_is_refused_at_setup)
    lengths=st.lists(st.integers(2, 90), min_size=2, max_size=40),
    mode=st.sampled_from(["packing", "dynamic"]),
    overlong=st.sampled_from(["truncate", "drop"]),
    max_tokens=st.sampled_from([16, 48, 64]),
    pad=st.sampled_from([1, 3, 16]),
    world=st.integers(1, 3),
    accumulate=st.integers(1, 2),
    val_fraction=st.sampled_from([0.0, 0.2]),
)
# found by this property: after the drop, one sample is left and val_fraction=0.2 would take it (a clear error)
@example(
    lengths=[1, 17], mode="packing", overlong="drop", max_tokens=16, pad=1, world=1, accumulate=1, val_fraction=0.2
)
def test_the_datamodule_trains_every_kept_sample_once_within_budget_and_counts_the_rest(
    lengths: list[int], mode: str, overlong: str, max_tokens: int, pad: int, world: int, accumulate: int, val_fraction
) -> None:
    records = [{"input_ids": [1 + i % 7] * n, "index": i} for i, n in enumerate(lengths)]
    pad = pad if mode == "packing" else 1
    budget = max_tokens - max_tokens % pad  # what a document may hold once padded to a multiple of pad
    over = [i for i, n in enumerate(lengths) if n > budget]
    kept = set(range(len(lengths))) - (set(over) if overlong == "drop" else set())
    if not kept or (val_fraction and len(kept) == 1):  # nothing left to train on: refused, naming the knob
        with pytest.raises(ValueError, match="overlong='drop' would drop all" if not kept else "val_fraction=0.2"):
            SeqPackDataModule(
                source=records,
                mode=mode,
                max_tokens=max_tokens,
                overlong=overlong,
                val_fraction=val_fraction,
                pad_to_multiple_of=pad,
            ).setup("fit")  # fmt: skip
        return
    trained: list[int] = []
    for rank in range(world):
        dm = SeqPackDataModule(
            source=records,
            mode=mode,
            max_tokens=max_tokens,
            overlong=overlong,
            val_fraction=val_fraction,
            pad_to_multiple_of=pad,
        )  # fmt: skip
        dm.trainer = _Layout(world, rank, accumulate)
        dm.setup("fit")
        loader = dm.train_dataloader()
        view = loader.dataset.dataset  # the training split, as the loader's PlannedDataset reads it
        for mb, batch in zip(loader.batch_sampler, dm.train_dataloader(), strict=True):
            assert batch["input_ids"].numel() <= max_tokens
            trained += [view[i]["index"] for i in mb]
    validation = dm.val_dataloader()  # [] when the held-out samples have no loss token (val/loss would be NaN)
    assert validation == [] or validation.dataset.dataset is dm.splits["val"].dataset
    held_out = _original_indices(dm.splits["val"].dataset) if val_fraction else []
    report = dm.overlong_report
    expected = (len(over), 0) if overlong == "drop" else (0, len(over))
    assert report.num_overlong == len(over) and (report.num_dropped, report.num_truncated) == expected
    assert sorted(trained) == sorted(kept - set(held_out))  # each kept training sample once over all ranks
    assert set(held_out) <= kept
