from __future__ import annotations

import numpy as np

from lit_seqpack._hashing import hashed_uniform


def test_pure_function_of_seed_index_and_stream():
    idx = np.arange(100_000, dtype=np.uint64)
    u = hashed_uniform(3, idx, 1)
    assert ((u > 0) & (u < 1)).all()
    picked = np.array([99_999, 5, 42_000], dtype=np.uint64)
    assert np.array_equal(hashed_uniform(3, picked, 1), u[picked.astype(np.int64)])  # order and subset free
    assert (hashed_uniform(4, idx, 1) != u).mean() > 0.999
    assert (hashed_uniform(3, idx, 2) != u).mean() > 0.999
    assert hashed_uniform(2**63 - 1, idx[:3], 0).shape == (3,)


def test_uniform_and_uncorrelated():
    idx = np.arange(200_000, dtype=np.uint64)
    u = hashed_uniform(0, idx, 1)
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    assert np.abs(counts - 10_000).max() < 500  # ~5 standard deviations
    v = hashed_uniform(0, idx, 2)
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.01  # neighbouring indices are independent
