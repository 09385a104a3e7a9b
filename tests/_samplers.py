"""``planned_sampler(mode, lengths, **knobs)``: a :class:`PlannedBatchSampler` from the knobs tests spell flat.

The mode samplers (``PackedBatchSampler``, ...) are gone; tests that sweep modes or pass knobs as one dict build the
:class:`~lit_seqpack.planning.PlanConfig` through this helper, splitting the sampler's own arguments off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lit_seqpack.data.indexed.planned_sampler import PlannedBatchSampler, resolve_replicas
from lit_seqpack.planning.config import PlanConfig

SAMPLER_ARGUMENTS = ("rank", "loss_tokens", "verify_plan", "content_digest")


def planned_sampler(mode: str, lengths: Sequence[int], *, num_replicas: int | None = None, **knobs: Any) -> Any:
    """``PlannedBatchSampler(lengths, PlanConfig(mode=mode, world_size=..., **config_knobs), **sampler_arguments)``."""
    own = {name: knobs.pop(name) for name in SAMPLER_ARGUMENTS if name in knobs}
    world, rank = resolve_replicas(num_replicas, own.pop("rank", None))
    return PlannedBatchSampler(lengths, PlanConfig(mode=mode, world_size=world, **knobs), rank=rank, **own)
