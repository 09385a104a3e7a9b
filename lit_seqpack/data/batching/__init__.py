"""What both pipelines share: how samples become a batch of the contract (:mod:`lit_seqpack.batch`).

* :mod:`~lit_seqpack.data.batching.collate`: :class:`PackedCollator` (one row, ``cu_seqlens``) and
  :class:`PaddedCollator` (``[B, L]`` blocks), each microbatch checked against its plan (sample lengths, budget, loss
  tokens);
* :mod:`~lit_seqpack.data.batching.fields`: the declared per-token and per-sample fields that travel with the tokens;
* :mod:`~lit_seqpack.data.batching.overlong`: the over-long policy (error, truncate, drop), counted and reported;
* :mod:`~lit_seqpack.data.batching.loss_weights`: per-token loss weights and the step's planned weight sum;
* :mod:`~lit_seqpack.data.batching.context_parallel`: the context- and tensor-parallel collators;
* ``_samples.py``: the per-sample rules both pipelines apply (tokens, labels, loss tokens).

The most used names are exported from :mod:`lit_seqpack.data`.
"""

from __future__ import annotations
