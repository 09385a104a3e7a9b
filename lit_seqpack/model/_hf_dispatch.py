"""What a transformers model's attention was before :func:`~lit_seqpack.model.hf.prepare_hf_model` switched it.

:func:`~lit_seqpack.model.hf.prepare_hf_model` records, for every config of the model (the top-level one, those of
its sub-models and their ``sub_configs``), the ``_attn_implementation`` it had, in an :class:`AttentionRecord` kept
on the model. :func:`original_implementation` reads it back for one config (what a call without packing metadata
delegates to) and :func:`restore` puts every config back. The record re-registers itself when the model is
unpickled or deep-copied (``ddp_spawn``, ``torch.save`` of a whole model, ``copy.deepcopy``).

Configs are looked up by identity (they are not hashable); an entry dies with its config.
"""

from __future__ import annotations

import weakref
from typing import Any

RECORD_ATTR = "_lit_seqpack_attention_record"
"""The attribute of the top-level model that holds its :class:`AttentionRecord`."""

_ORIGINALS: dict[int, tuple[weakref.ref[Any], str | None]] = {}


class AttentionRecord:
    """The attention implementation of each config of a model, before lit_seqpack switched it.

    Args:
        entries: ``(config, implementation)`` pairs, one per distinct config object.
    """

    def __init__(self, entries: list[tuple[Any, str | None]]) -> None:
        self.entries = entries
        self.register()

    def register(self) -> None:
        """Make :func:`original_implementation` answer for this record's configs."""
        for config, implementation in self.entries:
            key = id(config)
            _ORIGINALS[key] = (weakref.ref(config, lambda _, key=key: _ORIGINALS.pop(key, None)), implementation)

    def unregister(self) -> None:
        """Forget this record's configs."""
        for config, _ in self.entries:
            entry = _ORIGINALS.get(id(config))
            if entry is not None and entry[0]() is config:
                del _ORIGINALS[id(config)]

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.entries = state["entries"]
        self.register()


def model_configs(model: Any) -> list[Any]:
    """Every distinct config object of ``model``: its sub-models' configs and, recursively, their sub-configs."""
    from transformers import PreTrainedModel

    found: dict[int, Any] = {}
    stack = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while stack:
        config = stack.pop(0)
        if id(config) in found:
            continue
        found[id(config)] = config
        stack += [sub for key in getattr(config, "sub_configs", {}) if (sub := getattr(config, key, None)) is not None]
    return list(found.values())


def record(model: Any) -> AttentionRecord:
    """The model's :class:`AttentionRecord`, created (from its current implementations) on the first call."""
    existing = getattr(model, RECORD_ATTR, None)
    if existing is not None:
        return existing
    entries = [(config, config._attn_implementation) for config in model_configs(model)]
    new = AttentionRecord(entries)
    object.__setattr__(model, RECORD_ATTR, new)  # a plain attribute: not a submodule, not in the state dict
    return new


def original_implementation(config: Any) -> str | None:
    """The implementation ``config`` had before lit_seqpack switched it.

    Raises:
        LookupError: ``config`` belongs to no model prepared in this process.
    """
    entry = _ORIGINALS.get(id(config))
    if entry is None or entry[0]() is not config:
        raise LookupError(
            f"{type(config).__name__} is set to lit_seqpack's attention but its model was not prepared in this "
            "process, so its original attention implementation is unknown; call "
            "lit_seqpack.model.hf.prepare_hf_model(model) on the loaded model"
        )
    return entry[1]


def restore(model: Any) -> Any:
    """Put every config of ``model`` back on its recorded implementation and drop the record; returns ``model``.

    Raises:
        ValueError: ``model`` was never prepared.
    """
    existing = getattr(model, RECORD_ATTR, None)
    if existing is None:
        raise ValueError(
            f"{type(model).__name__} was not prepared by lit_seqpack.model.hf.prepare_hf_model: nothing to restore"
        )
    for config, implementation in existing.entries:
        config._attn_implementation_internal = implementation
    existing.unregister()
    object.__delattr__(model, RECORD_ATTR)
    return model
