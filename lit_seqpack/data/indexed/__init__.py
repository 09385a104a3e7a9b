"""The map-style pipeline: :class:`~lit_seqpack.data.indexed.pipeline.IndexedPipeline`.

* :mod:`~lit_seqpack.data.indexed.validation` and :mod:`~lit_seqpack.data.indexed.lengths`: every sample validated
  once, its length and loss tokens computed (and cached);
* :mod:`~lit_seqpack.data.indexed.splits`: the held-out validation and test splits;
* :mod:`~lit_seqpack.data.indexed.planned_sampler` and :mod:`~lit_seqpack.data.indexed.samplers`: a rank's view of
  the plan, stateful;
* ``_loader.py``, ``_resume.py``, ``_eval_data.py``: the resumable loader, the checkpoint checks, the evaluation
  splits read from their own sources;
* ``_reads.py``: a user's ``dataset[i]`` that raises is named by its index and class; ``_changing.py``: what a
  dataset that declares ``lengths_change_per_epoch`` needs to be re-planned every epoch.

The names are exported from :mod:`lit_seqpack.data`.
"""
