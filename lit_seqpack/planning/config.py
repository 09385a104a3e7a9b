"""What to plan: :class:`PlanConfig`, the batching mode, its budget and the distributed layout.

It lives apart from the planner (``plan.py`` builds plans, ``_windows.py`` plans one window, ``_order.py``
orders an epoch; all of them read a config) so that nothing imports back up: this module imports no other
planning module at import time. ``lit_seqpack.planning.plan`` re-exports its names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from lit_seqpack._checks import check_int

__all__ = ["MICROBATCH_ORDERS", "MODES", "PlanConfig"]

MODES: tuple[str, ...] = ("packing", "dynamic", "padded")
MICROBATCH_ORDERS: tuple[str, ...] = ("packer", "largest_first")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanConfig:
    """What to plan: the batching mode, its budget and the distributed layout.

    Args:
        mode: ``"packing"`` (rows of concatenated documents), ``"dynamic"`` (padded ``[rows, L]`` blocks
            under a token budget) or ``"padded"`` (fixed ``batch_size``, the baseline). One field, so
            packing and dynamic batching cannot both be on.
        max_tokens: token budget of a microbatch (packing: the row length after rounding; dynamic:
            ``rows x round_up(longest, sequence_length_round)``). Required for packing and dynamic,
            must be ``None`` for padded.
        algorithm: packing algorithm (a name in :data:`~lit_seqpack.planning.algorithms.ALGORITHMS`); only
            for packing, where ``None`` means :data:`~lit_seqpack.planning.algorithms.DEFAULT_ALGORITHM`.
        window: consecutive shuffled samples planned together; window ``i`` trains entirely before
            window ``i + 1``. ``None``: the whole epoch (the most efficient; sort-based packers then give
            the same microbatch count every epoch) up to ``max(2**22, 128 steps)`` samples; larger data is
            cut into fixed chunks of that size, the same every epoch, trained in a new order each epoch
            (memory stays bounded and the count stays constant; see ``planning._order``).
        sequence_length_round: rows are padded to a multiple of this (packing: the packed row;
            dynamic/padded: the longest row). ``max_tokens`` must be a multiple of it.
        batch_size: samples per microbatch in padded mode (required there, ``None`` otherwise).
        world_size: number of data-parallel ranks.
        accumulate_grad_batches: microbatches per rank per optimizer step.
        seed: seed of the shuffles (>= 0).
        shuffle: shuffle samples (and steps) with ``(seed, epoch)``; ``False`` gives the same plan
            every epoch.
        microbatch_order: ``"largest_first"`` runs each rank's costliest microbatch of a step first and
            puts the step holding the window's costliest microbatch first (allocator sees the peak
            shape first); ``"packer"`` keeps the packer's order within a rank's step.
        cost_linear: ``a`` in the per-document cost ``a*L + b*L^2`` that ranks are balanced on.
        cost_quadratic: ``b`` in that cost (attention-heavy long contexts); dynamic and padded blocks
            cost ``rows x (a*Lp + b*Lp^2)`` with ``Lp`` the padded length. ``"auto"`` (the default) is
            ``cost_linear / max_tokens``: a document as long as the budget spends as much on attention as on
            the rest of the layer, so a step of a few long documents is not dealt to one rank as if it cost
            its tokens (see :attr:`quadratic_cost`); padded mode has no budget and balances on ``L`` alone.
    """

    mode: str = "packing"
    max_tokens: int | None = None
    algorithm: str | None = None
    window: int | None = None
    sequence_length_round: int = 1
    batch_size: int | None = None
    world_size: int = 1
    accumulate_grad_batches: int = 1
    seed: int = 0
    shuffle: bool = True
    microbatch_order: str = "largest_first"
    cost_linear: float = 1.0
    cost_quadratic: float | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name, minimum in (("sequence_length_round", 1), ("world_size", 1), ("accumulate_grad_batches", 1)):
            check_int(name, getattr(self, name), minimum=minimum)
        check_int("seed", self.seed, minimum=0)
        if self.window is not None:
            check_int("window", self.window, minimum=1)
        if not isinstance(self.shuffle, (bool, np.bool_)):
            raise ValueError(f"shuffle must be a bool, got {self.shuffle!r}")
        if self.microbatch_order not in MICROBATCH_ORDERS:
            raise ValueError(f"microbatch_order must be one of {MICROBATCH_ORDERS}, got {self.microbatch_order!r}")
        for name, allowed in (("cost_linear", ""), ("cost_quadratic", " or 'auto'")):
            value = getattr(self, name)
            if allowed and isinstance(value, str) and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0{allowed}, got {value!r}")
        self._check_mode_settings()
        if self.cost_linear == 0 and self.quadratic_cost == 0:
            raise ValueError("cost_linear and cost_quadratic cannot both be 0")

    def _check_mode_settings(self) -> None:
        if self.algorithm is not None:
            from lit_seqpack.planning.algorithms import packing_algorithm

            if self.mode != "packing":
                raise ValueError(f"algorithm={self.algorithm!r} only applies to mode='packing', not {self.mode!r}")
            packing_algorithm(self.algorithm)
        if self.mode == "padded":
            if self.max_tokens is not None:
                raise ValueError(f"max_tokens={self.max_tokens!r} does not apply to mode='padded' (use batch_size)")
            check_int("batch_size", self.batch_size, minimum=1)
            return
        if self.batch_size is not None:
            raise ValueError(f"batch_size={self.batch_size!r} only applies to mode='padded', not {self.mode!r}")
        check_int("max_tokens", self.max_tokens, minimum=1)
        if self.max_tokens % self.sequence_length_round:
            raise ValueError(
                f"max_tokens={self.max_tokens} must be a multiple of sequence_length_round={self.sequence_length_round}"
            )

    @property
    def quadratic_cost(self) -> float:
        """The ``b`` ranks are balanced on: ``cost_quadratic``, or for ``"auto"`` ``cost_linear / max_tokens``.

        Why the budget: per token, a transformer layer spends a constant on its projections and MLP and a
        term that grows with the document's length on attention. Their ratio depends on the model (about
        ``L / (12 d)`` in FLOPs for hidden size ``d``, more in time since attention kernels run below matmul
        peak), which the planner does not know; the budget is the one length scale it does know, and ``b =
        a / max_tokens`` weighs a full-budget document's attention like its linear work. Packed rows are
        near full, so their token balance does not move (bench_plan's balance table), while the per-step
        attention-heavy cost goes from 1.15-1.32 max/mean over ranks to 1.002-1.004.

        Example:
            >>> PlanConfig(mode="packing", max_tokens=4096).quadratic_cost == 1 / 4096
            True
        """
        if not isinstance(self.cost_quadratic, str):
            return float(self.cost_quadratic)
        return self.cost_linear / self.max_tokens if self.max_tokens else 0.0

    @property
    def slots_per_step(self) -> int:
        """Microbatches per optimizer step over all ranks: ``world_size x accumulate_grad_batches``."""
        return self.world_size * self.accumulate_grad_batches
