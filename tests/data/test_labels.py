from __future__ import annotations

import torch

from lit_seqpack.data.labels import IGNORE_INDEX, shift_labels


def test_shift_labels_aligns_each_position_with_the_next_label():
    labels = torch.tensor([[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7]])
    assert shift_labels(labels).tolist() == [[5, 6, IGNORE_INDEX, 7, IGNORE_INDEX]]
    assert labels.tolist() == [[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7]]  # the input is not modified
