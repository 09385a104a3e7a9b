"""How many token ids a model can embed, read from the model itself (its config or hyperparameters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["model_vocab_size"]


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
    if value is None:  # a vision-language model: its text model's vocabulary
        value = getattr(getattr(inner_config, "text_config", None), "vocab_size", None)
    hparams = getattr(model, "hparams", None) or {}
    if value is None:
        value = hparams.get("vocab_size")
    if value is None and isinstance(hparams.get("config"), Mapping):
        value = hparams["config"].get("vocab_size")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
