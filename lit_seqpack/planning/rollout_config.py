"""What to plan for one RL rollout: :class:`RolloutPlanConfig` (its own module, so the rollout planner's helper
modules can name it without an import circle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lit_seqpack._checks import check_choice, check_flag, check_int, check_optional_int

__all__ = ["KEEP_TOGETHER", "ROLLOUT_MODES", "RolloutPlanConfig"]

ROLLOUT_MODES: tuple[str, ...] = ("packing", "dynamic")
KEEP_TOGETHER: tuple[str | None, ...] = (None, "microbatch", "rank")


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutPlanConfig:
    """What to plan for one rollout.

    Args:
        max_tokens: the token budget of a microbatch (packing: tokens of the row; dynamic: ``rows x padded length``).
        mode: ``"packing"`` or ``"dynamic"``.
        algorithm: the packer, a name in :data:`~lit_seqpack.planning.algorithms.ALGORITHMS` (packing only;
            ``None``: :data:`~lit_seqpack.planning.algorithms.DEFAULT_ALGORITHM`).
        world_size: data-parallel ranks.
        samples_per_step: samples of one optimizer step over all ranks; the rollout size must be a multiple.
        steps_per_rollout: instead, the exact number of optimizer steps (near-equal sample counts).
        accumulate_grad_batches: microbatches per rank per step, fixed (what a Lightning Trainer with automatic
            optimization needs); ``None`` uses as many as the fullest rank of any step needs.
        keep_together: ``None``, ``"microbatch"`` (a group is never split across microbatches; a group longer than
            ``max_tokens`` is refused) or ``"rank"`` (whole groups are dealt to ranks, then their samples are packed
            one by one, so a group may span several microbatches of its rank; a group longer than a rank's whole
            step is refused); groups are never split across steps either way.
        sequence_length_round: dynamic mode pads a block's length to a multiple of this.
        cost_linear: ``a`` of the cost ``a*L + b*L^2`` ranks are balanced on.
        cost_quadratic: ``b``; ``"auto"`` is ``cost_linear / max_tokens``.
        shuffle: shuffle the order of samples (of groups) before cutting steps, with ``seed``.
        seed: the shuffle's seed.
    """

    max_tokens: int
    mode: str = "packing"
    algorithm: str | None = None
    world_size: int = 1
    samples_per_step: int | None = None
    steps_per_rollout: int | None = None
    accumulate_grad_batches: int | None = None
    keep_together: Literal["microbatch", "rank"] | None = None
    sequence_length_round: int = 1
    cost_linear: float = 1.0
    cost_quadratic: float | Literal["auto"] = "auto"
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, ROLLOUT_MODES)
        check_choice("keep_together", self.keep_together, KEEP_TOGETHER)
        for name, minimum in (("max_tokens", 1), ("world_size", 1), ("sequence_length_round", 1), ("seed", 0)):
            check_int(name, getattr(self, name), minimum=minimum)
        for name in ("samples_per_step", "steps_per_rollout", "accumulate_grad_batches"):
            check_optional_int(name, getattr(self, name), minimum=1)
        if self.samples_per_step is not None and self.steps_per_rollout is not None:
            raise ValueError(
                f"give samples_per_step ({self.samples_per_step}) or steps_per_rollout ({self.steps_per_rollout}), "
                "not both"
            )
        if self.algorithm is not None:
            from lit_seqpack.planning.algorithms import packing_algorithm

            if self.mode != "packing":
                raise ValueError(f"algorithm={self.algorithm!r} is only read in mode 'packing', not {self.mode!r}")
            packing_algorithm(self.algorithm)
        if self.max_tokens % self.sequence_length_round:
            raise ValueError(
                f"max_tokens={self.max_tokens} must be a multiple of sequence_length_round={self.sequence_length_round}"
            )
        for name in ("cost_linear", "cost_quadratic"):
            value = getattr(self, name)
            if name == "cost_quadratic" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        check_flag("shuffle", self.shuffle)

    @property
    def quadratic_cost(self) -> float:
        """``b`` of the balance cost: ``cost_quadratic``, or ``cost_linear / max_tokens`` for ``"auto"``."""
        return self.cost_linear / self.max_tokens if self.cost_quadratic == "auto" else float(self.cost_quadratic)
