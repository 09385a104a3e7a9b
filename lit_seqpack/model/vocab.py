"""How many token ids a model can embed, and the longest row it accepts, read from the model itself (its config or
hyperparameters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["model_max_seq_len", "model_vocab_size"]


def model_vocab_size(model: Any) -> int | None:
    """The number of token ids ``model`` can embed, or ``None`` when it does not say.

    Looked up, in order: the ``config.vocab_size`` of the wrapped network ``model.model`` (the reference decoder
    and transformers models both have one), then the hyperparameter ``vocab_size``, then the ``vocab_size`` of a
    ``config`` hyperparameter (:class:`~lit_seqpack.model.lm.HFCausalLM` built from a config dict).

    Example:
        >>> from types import SimpleNamespace
        >>> model_vocab_size(SimpleNamespace(hparams={"config": {"vocab_size": 64}}))
        64
        >>> model_vocab_size(SimpleNamespace()) is None
        True
    """
    inner_config = getattr(getattr(model, "model", None), "config", None)
    value = getattr(inner_config, "vocab_size", None)
    hparams = getattr(model, "hparams", None) or {}
    if value is None:
        value = hparams.get("vocab_size")
    if value is None and isinstance(hparams.get("config"), Mapping):
        value = hparams["config"].get("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def model_max_seq_len(model: Any) -> int | None:
    """The longest row ``model`` accepts, or ``None`` when it sets no limit.

    Read from the wrapped network's ``config.max_seq_len`` (the reference decoder), then the hyperparameter
    ``max_seq_len``. A transformers model sets none (its ``max_position_embeddings`` is no hard limit).

    Example:
        >>> from types import SimpleNamespace
        >>> model_max_seq_len(SimpleNamespace(hparams={"max_seq_len": 512}))
        512
    """
    value = getattr(getattr(getattr(model, "model", None), "config", None), "max_seq_len", None)
    if value is None:
        value = (getattr(model, "hparams", None) or {}).get("max_seq_len")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
