"""Deprecated path: the planned batch sampler lives in :mod:`lit_seqpack.data.planned_sampler`."""

from __future__ import annotations

from lit_seqpack.data.planned_sampler import PLAN_FORMAT, PlannedBatchSampler, RankSampler, resolve_replicas

__all__ = ["PLAN_FORMAT", "PlannedBatchSampler", "RankSampler", "resolve_replicas"]
