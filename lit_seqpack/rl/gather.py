"""``gather_rollout``: every rank's generated samples into the one rollout every rank must plan.

Generation is sharded (each data-parallel rank samples its own prompts), the plan is not: every rank plans the same
rollout. One ``all_gather_object`` of each rank's samples (ids, loss masks, declared fields, group ids, as numpy
arrays) builds it, in a fixed order (rank 0's samples, then rank 1's, ...), so every rank holds an identical
:class:`~lit_seqpack.rl.Rollout` with an identical fingerprint.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch

from lit_seqpack.rl.rollout import Rollout

__all__ = ["gather_rollout"]


def _parts(rollout: Rollout | None) -> dict[str, Any] | None:
    if rollout is None:
        return None
    sizes = rollout.lengths.tolist()

    def flat(values: list[torch.Tensor]) -> np.ndarray:
        return torch.cat(list(values)).numpy()

    return {
        "lengths": np.asarray(sizes, dtype=np.int64),
        "input_ids": flat(rollout.input_ids),
        "loss_mask": flat(rollout.loss_mask),
        "token_fields": {name: flat(values) for name, values in rollout.token_fields.items()},
        "sample_fields": {name: values.numpy() for name, values in rollout.sample_fields.items()},
        "group_ids": None if rollout.group_ids is None else rollout.group_ids.numpy(),
    }


def _declared(parts: dict[str, Any]) -> tuple[Any, ...]:
    return (sorted(parts["token_fields"]), sorted(parts["sample_fields"]), parts["group_ids"] is None)


def gather_rollout(
    local: Rollout | None, *, group_ids: Literal["local", "global"] = "local", group: Any = None
) -> Rollout:
    """The rollout of every rank's samples, identical on every rank (one ``all_gather_object``).

    Args:
        local: this rank's generated samples (``None`` when it generated none).
        group_ids: ``"local"``: each rank numbered its own groups (GRPO prompts ``0..G-1`` on every rank), so rank
            ``r``'s group ``g`` becomes its own group (renumbered ``0..`` in order of appearance); ``"global"``: the
            ids are already unique across ranks and kept (a group may then span ranks).
        group: the process group of the data-parallel ranks (default: the default group).

    Returns:
        A :class:`~lit_seqpack.rl.Rollout`: rank 0's samples, then rank 1's, ..., with every declared field.

    Raises:
        ValueError: on every rank, when the ranks declare different fields or some use group ids and others not,
            or when no rank has a sample.
    """
    import torch.distributed as dist

    if group_ids not in ("local", "global"):
        raise ValueError(f"group_ids must be 'local' or 'global', got {group_ids!r}")
    if local is not None and not isinstance(local, Rollout):
        raise TypeError(f"expected a lit_seqpack.rl.Rollout or None, got {type(local).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        if local is None:
            raise ValueError("gather_rollout: no rank has a sample")
        return local
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, _parts(local), group=group)
    present = [(rank, parts) for rank, parts in enumerate(gathered) if parts is not None]
    if not present:
        raise ValueError("gather_rollout: no rank has a sample")
    declared = {rank: _declared(parts) for rank, parts in present}
    if len(set(map(repr, declared.values()))) > 1:
        shown = "; ".join(f"rank {r}: token {d[0]}, sample {d[1]}, groups {not d[2]}" for r, d in declared.items())
        raise ValueError(f"gather_rollout: the ranks declare different fields or group ids ({shown})")
    return _concatenate([parts for _, parts in present], [rank for rank, _ in present], group_ids)


def _concatenate(parts: list[dict[str, Any]], ranks: list[int], group_ids: str) -> Rollout:
    lengths = np.concatenate([p["lengths"] for p in parts]).tolist()

    def joined(key: str, name: str | None = None) -> list[torch.Tensor]:
        values = [p[key] if name is None else p[key][name] for p in parts]
        return list(torch.from_numpy(np.concatenate(values)).split(lengths))

    groups = None
    if parts[0]["group_ids"] is not None:
        if group_ids == "local":  # (rank, local id) pairs, numbered in order of appearance
            pairs = np.concatenate(
                [
                    np.stack([np.full(p["group_ids"].size, r), p["group_ids"]], 1)
                    for r, p in zip(ranks, parts, strict=True)
                ]
            )
            _, first, dense = np.unique(pairs, axis=0, return_index=True, return_inverse=True)
            order = np.empty(first.size, dtype=np.int64)
            order[np.argsort(first, kind="stable")] = np.arange(first.size)
            groups = torch.from_numpy(order[dense.reshape(-1)])
        else:
            groups = torch.from_numpy(np.concatenate([p["group_ids"] for p in parts]))
    return Rollout(
        input_ids=joined("input_ids"),
        loss_mask=joined("loss_mask"),
        token_fields={name: joined("token_fields", name) for name in parts[0]["token_fields"]},
        sample_fields={
            name: torch.from_numpy(np.concatenate([p["sample_fields"][name] for p in parts]))
            for name in parts[0]["sample_fields"]
        },
        group_ids=groups,
    )
