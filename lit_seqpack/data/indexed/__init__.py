"""The map-style pipeline: :class:`~lit_seqpack.data.indexed.pipeline.IndexedPipeline`.

* :mod:`~lit_seqpack.data.indexed.validation` and :mod:`~lit_seqpack.data.indexed.lengths`: every sample validated
  once, its length and loss tokens computed (and cached);
* :mod:`~lit_seqpack.data.indexed.splits`: the held-out validation and test splits;
* :mod:`~lit_seqpack.data.indexed.planned_sampler`: :class:`PlannedBatchSampler` (a rank's view of the plan, stateful)
  and :class:`PlannedDataset`;
* :mod:`~lit_seqpack.data.indexed.pipeline`: what the DataModule delegates to, with the evaluation splits read from
  their own sources and the re-planning of a dataset that declares ``lengths_change_per_epoch``;
* ``_loader.py``, ``_resume.py``: the resumable loader and the checkpoint checks (shared with the stream pipeline);
* ``_reads.py``: a user's ``dataset[i]`` that raises is named by its index and class.

The most used names are exported from :mod:`lit_seqpack.data`.
"""

from __future__ import annotations
