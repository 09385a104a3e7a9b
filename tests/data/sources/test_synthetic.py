from __future__ import annotations

import dataclasses
import inspect
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from lit_seqpack.data.sources.synthetic import (
    BOS_ID,
    EOS_ID,
    FIRST_PAYLOAD_ID,
    PAD_ID,
    SEP_ID,
    SYNTHETIC_TASKS,
    TASK_TOKEN_IDS,
    SyntheticInstructionDataset,
    SyntheticTaskConfig,
)

TASK_OF_TOKEN = {v: k for k, v in TASK_TOKEN_IDS.items()}


def _split(sample):
    ids = sample["input_ids"].tolist()
    sep = ids.index(SEP_ID)
    return ids[: sep + 1], ids[sep + 1 :]


def test_reserved_ids_are_distinct_and_below_payload():
    reserved = [PAD_ID, BOS_ID, EOS_ID, SEP_ID, *TASK_TOKEN_IDS.values()]
    assert len(set(reserved)) == len(reserved)
    assert max(reserved) < FIRST_PAYLOAD_ID
    assert set(TASK_TOKEN_IDS) == set(SYNTHETIC_TASKS)


def test_same_seed_same_samples_different_seed_different_samples():
    a = SyntheticInstructionDataset(num_samples=500, seed=7)
    b = SyntheticInstructionDataset(num_samples=500, seed=7)
    c = SyntheticInstructionDataset(num_samples=500, seed=8)
    order = np.random.default_rng(0).permutation(200)  # reading order must not matter
    for i in order:
        assert torch.equal(a[int(i)]["input_ids"], b[int(i)]["input_ids"])
        assert torch.equal(a[int(i)]["labels"], b[int(i)]["labels"])
    differ = sum(not torch.equal(a[i]["input_ids"], c[i]["input_ids"]) for i in range(200))
    assert differ == 200
    assert (a.lengths != c.lengths).mean() > 0.9


def test_samples_identical_in_another_process():
    code = (
        "from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset as D\n"
        "d = D(num_samples=300, seed=11, length_distribution='power_law')\n"
        "print([d[i]['input_ids'].tolist() for i in range(0, 300, 37)])\n"
        "print(d.lengths.tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    here = SyntheticInstructionDataset(num_samples=300, seed=11, length_distribution="power_law")
    assert out[0] == str([here[i]["input_ids"].tolist() for i in range(0, 300, 37)])
    assert out[1] == str(here.lengths.tolist())


@pytest.mark.parametrize("distribution", ["lognormal", "power_law", "uniform"])
def test_lengths_array_matches_samples(distribution):
    ds = SyntheticInstructionDataset(num_samples=5000, length_distribution=distribution, min_length=9, max_length=700)
    for i in range(0, 5000, 17):  # ~300 indices
        sample = ds[i]
        assert len(sample["input_ids"]) == len(sample["labels"]) == ds.lengths[i]
        assert ds.loss_tokens[i] == int((sample["labels"][1:] != -100).sum())
    assert ds.lengths.min() >= 10 and ds.lengths.max() <= 700  # odd min_length 9: shortest even length is 10
    assert (ds.lengths % 2 == 0).all()


def test_lognormal_median_and_heavy_tail():
    ds = SyntheticInstructionDataset(num_samples=200_000, median_length=128, sigma=1.0, max_length=8192)
    lengths = ds.lengths
    assert abs(np.median(lengths) - 128) <= 2
    above = (lengths > 4 * 128).mean()  # P(z > ln 4) = 0.083 for sigma = 1
    assert 0.07 < above < 0.095
    assert np.percentile(lengths, 99) > 8 * np.median(lengths)
    assert lengths.max() > 3000


def test_power_law_median_and_tail_exponent():
    ds = SyntheticInstructionDataset(
        num_samples=200_000, length_distribution="power_law", median_length=200, alpha=1.5, max_length=100_000
    )
    lengths = ds.lengths
    assert abs(np.median(lengths) - 200) <= 2
    assert abs((lengths > 800).mean() / (lengths > 200).mean() - 4**-1.5) < 0.01  # Pareto: 4^-alpha
    assert np.percentile(lengths, 99.9) > 40 * 200


def test_uniform_lengths_cover_the_range_evenly():
    ds = SyntheticInstructionDataset(num_samples=100_000, length_distribution="uniform", min_length=8, max_length=1000)
    quartiles = np.percentile(ds.lengths, [25, 50, 75])
    assert np.allclose(quartiles, [256, 504, 752], atol=12)


def test_lengths_for_a_million_samples_vectorised():
    ds = SyntheticInstructionDataset(num_samples=1_000_000, seed=5)
    lengths = ds.lengths
    assert lengths.shape == (1_000_000,) and lengths.dtype == np.int64
    assert not lengths.flags.writeable
    assert len(ds[999_999]["input_ids"]) == lengths[999_999]
    assert ds.loss_tokens.sum() == ((lengths - 4) // 2 + 1).sum()


def test_labels_mask_exactly_the_prompt():
    ds = SyntheticInstructionDataset(num_samples=300, seed=2)
    for i in range(300):
        sample = ds[i]
        ids, labels = sample["input_ids"], sample["labels"]
        prompt, response = _split(sample)
        assert prompt[0] == BOS_ID and prompt[1] in TASK_OF_TOKEN and response[-1] == EOS_ID
        assert len(response) == len(prompt) - 2  # n + 1 response tokens for n + 3 prompt tokens
        assert (labels[: len(prompt)] == -100).all()
        assert torch.equal(labels[len(prompt) :], ids[len(prompt) :])
        assert ids.dtype == labels.dtype == torch.int64
        assert (ids != PAD_ID).all()


def _reference_response(task, payload, vocab_size):
    """An independent statement of each task; the permutation is checked separately."""
    p = len(range(FIRST_PAYLOAD_ID, vocab_size))
    if task == "copy":
        return payload
    if task == "reverse":
        return payload[::-1]
    if task == "sort":
        return sorted(payload)
    if task == "shift":
        return [FIRST_PAYLOAD_ID + (x - FIRST_PAYLOAD_ID + 1) % p for x in payload]
    return None


def test_response_is_a_deterministic_function_of_the_prompt():
    vocab = 40
    ds = SyntheticInstructionDataset(num_samples=400, vocab_size=vocab, tasks=SYNTHETIC_TASKS, seed=4)
    other = SyntheticInstructionDataset(num_samples=400, vocab_size=vocab, tasks=SYNTHETIC_TASKS, seed=99)
    mapping: dict[int, int] = {}
    seen = set()
    for data in (ds, other):
        for i in range(400):
            prompt, response = _split(data[i])
            task = TASK_OF_TOKEN[prompt[1]]
            seen.add(task)
            assert response == data.response_for(prompt).tolist()
            payload = prompt[2:-1]
            expected = _reference_response(task, payload, vocab)
            if expected is not None:
                assert response[:-1] == expected
            else:  # permute: one fixed map shared by every sample and every seed
                for x, y in zip(payload, response[:-1], strict=True):
                    assert mapping.setdefault(x, y) == y
    assert seen == set(SYNTHETIC_TASKS)
    assert len(set(mapping.values())) == len(mapping)  # a bijection on the payload ids seen
    assert all(FIRST_PAYLOAD_ID <= y < vocab for y in mapping.values())


def test_only_configured_tasks_are_mixed_evenly():
    ds = SyntheticInstructionDataset(num_samples=20_000, tasks=["reverse", "sort"])
    counts = np.bincount(ds.task_ids(np.arange(20_000)), minlength=2)
    assert counts.min() > 9_500
    assert {TASK_OF_TOKEN[int(ds[i]["input_ids"][1])] for i in range(50)} == {"reverse", "sort"}
    assert ds.config.tasks == ("reverse", "sort")


def test_response_for_rejects_malformed_prompts():
    ds = SyntheticInstructionDataset(num_samples=10, vocab_size=32)
    with pytest.raises(ValueError, match="prompt must be"):
        ds.response_for([BOS_ID, TASK_TOKEN_IDS["copy"], 12])
    with pytest.raises(ValueError, match="not a task token"):
        ds.response_for([BOS_ID, 20, 12, SEP_ID])
    with pytest.raises(ValueError, match="payload ids"):
        ds.response_for([BOS_ID, TASK_TOKEN_IDS["copy"], 40, SEP_ID])


def test_pickles_and_indexes_like_a_sequence():
    ds = SyntheticInstructionDataset(num_samples=50, seed=3)
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[7]["input_ids"], ds[7]["input_ids"])
    assert torch.equal(ds[np.int64(7)]["input_ids"], ds[7]["input_ids"])
    for bad in (50, -1):
        with pytest.raises(IndexError):
            ds[bad]


def test_fingerprint_follows_the_config():
    base = SyntheticInstructionDataset(num_samples=100, seed=1)
    assert base.fingerprint == SyntheticInstructionDataset(num_samples=100, seed=1).fingerprint
    assert base.fingerprint != SyntheticInstructionDataset(num_samples=100, seed=2).fingerprint
    assert base.fingerprint != SyntheticInstructionDataset(num_samples=100, seed=1, sigma=0.5).fingerprint


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("num_samples", 0),
        ("vocab_size", FIRST_PAYLOAD_ID + 1),
        ("length_distribution", "zipf"),
        ("median_length", 5000),
        ("min_length", 5),
        ("max_length", 7),
        ("sigma", 0.0),
        ("alpha", -1.0),
        ("tasks", ()),
        ("tasks", ("copy", "copy")),
        ("tasks", ("translate",)),
        ("seed", -1),
    ],
)
def test_config_rejects_bad_values(knob, value):
    with pytest.raises(ValueError, match=knob):
        SyntheticTaskConfig(**{knob: value})


def test_uniform_ignores_median_and_max_length_must_fit_an_even_length():
    SyntheticTaskConfig(length_distribution="uniform", median_length=10_000)
    with pytest.raises(ValueError, match="max_length"):
        SyntheticTaskConfig(min_length=9, max_length=9, median_length=9)


def test_constructor_defaults_are_the_config_defaults():
    assert SyntheticInstructionDataset().config == SyntheticTaskConfig()
    params = inspect.signature(SyntheticInstructionDataset).parameters
    assert list(params) == [f.name for f in dataclasses.fields(SyntheticTaskConfig)]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
