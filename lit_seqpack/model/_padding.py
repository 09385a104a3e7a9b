"""Which padded batches need an attention mask: a causal row padded on the right does not.

A dynamic or padded microbatch is ``[B, L]`` with an ``attention_mask`` (1 on real tokens). When every row is its
real tokens followed by its padding, causal attention alone is exact for every real token: query ``t`` sees keys
``0..t``, all real, and the padding after them carries no loss (``labels`` is -100 there). So such a batch runs
with ``is_causal`` and no mask, which spares the dense ``[B, 1, L, L]`` mask and, on CUDA, lets SDPA pick its flash
kernel::

    right padded   1 1 1 1 0 0      -> no mask (causal)
                   1 1 0 0 0 0
    left padded    0 0 1 1 1 1      -> the mask stays
    a hole         1 1 0 1 0 0      -> the mask stays
"""

from __future__ import annotations

import torch

__all__ = ["is_right_padded"]


def is_right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row of a ``[B, L]`` padding mask is ones then zeros (nonzero counts as a real token).

    Exact, not a heuristic: one comparison of neighbours, read once on the host. A mask on the CPU costs no device
    sync; a mask on an accelerator costs one small read per call (call it once per forward, not per layer).

    Example:
        >>> is_right_padded(torch.tensor([[1, 1, 0], [1, 0, 0]])), is_right_padded(torch.tensor([[0, 1, 1]]))
        (True, False)
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, length], got shape {tuple(attention_mask.shape)}")
    if attention_mask.shape[1] < 2 or attention_mask.numel() == 0:
        return True
    keep = attention_mask.bool()
    return not bool((keep[:, 1:] & ~keep[:, :-1]).any())  # a real token right after a padding one
