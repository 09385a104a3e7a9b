"""What both pipelines share: how samples become a batch of the contract (:mod:`lit_seqpack.batch`).

* :mod:`~lit_seqpack.data.batching.collate`: :class:`PackedCollator` (one row, ``cu_seqlens``) and
  :class:`PaddedCollator` (``[B, L]`` blocks);
* :mod:`~lit_seqpack.data.batching.fields`: the declared per-token and per-sample fields that travel with the tokens;
* :mod:`~lit_seqpack.data.batching.overlong`: the over-long policy (error, truncate, drop), counted and reported;
* :mod:`~lit_seqpack.data.batching.loss_weights`: per-token loss weights and the step's planned weight sum;
* :mod:`~lit_seqpack.data.batching.context_parallel`: the context- and tensor-parallel collators;
* ``_plan_check.py``: each microbatch checked against its plan (sample lengths, budget, loss tokens).

The names are exported from :mod:`lit_seqpack.data`.
"""
