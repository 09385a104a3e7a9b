"""A trained :class:`~lit_seqpack.model.lm.ReferenceLM` as a plain folder: ``config.json`` + ``model.safetensors``.

No Lightning state and no pickle: the folder holds the model's constructor arguments and its weights, plus the
tokenizer it trained with when one is known. :func:`load_reference_lm` rebuilds the module from it::

    from lit_seqpack.model.reference_io import load_reference_lm
    model = load_reference_lm("outputs/text_sft/exported")   # ReferenceLM, eval mode
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from lit_seqpack._imports import require
from lit_seqpack.model.hf_load import DTYPES

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "load_reference_lm", "save_reference_lm"]

CONFIG_FILE = "config.json"
"""The constructor arguments: ``{"class_path": ..., "init_args": {...}}``."""

WEIGHTS_FILE = "model.safetensors"
"""The decoder's weights (``ReferenceLM.model``), tied embeddings stored once."""


def save_reference_lm(module: Any, path: str | Path, *, dtype: str | None = None, tokenizer: str | None = None) -> Path:
    """Write ``module`` (a ReferenceLM) as ``config.json`` + ``model.safetensors`` (+ the tokenizer) in ``path``.

    Args:
        module: the trained :class:`~lit_seqpack.model.lm.ReferenceLM`.
        path: the output folder (created).
        dtype: the saved weights' dtype (``"bfloat16"``, ...; default: as trained).
        tokenizer: a tokenizer folder to save alongside (``AutoTokenizer``), or ``None``.
    """
    safetensors = require("safetensors.torch", purpose="saving the weights")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = module.model
    if dtype is not None:
        if dtype not in DTYPES or dtype == "auto":
            raise ValueError(f"dtype={dtype!r} must be one of float32, bfloat16, float16")
        model = copy.deepcopy(model).to(DTYPES[dtype])
    init_args = {key: value for key, value in module.hparams.items() if not key.startswith("_")}
    config = {"class_path": f"{type(module).__module__}.{type(module).__qualname__}", "init_args": init_args}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    safetensors.save_model(model, str(out / WEIGHTS_FILE))
    if tokenizer is not None:
        transformers = require("transformers", purpose="saving the tokenizer")
        transformers.AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def load_reference_lm(path: str | Path) -> Any:
    """The :class:`~lit_seqpack.model.lm.ReferenceLM` written by :func:`save_reference_lm`, in eval mode.

    Raises:
        FileNotFoundError: ``path`` lacks ``config.json`` or ``model.safetensors``.
    """
    from lit_seqpack.model.lm import ReferenceLM

    safetensors = require("safetensors.torch", purpose="loading the weights")
    folder = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name}: missing (write the folder with `lit-seqpack export`)")
    config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    module = ReferenceLM(**config["init_args"])
    safetensors.load_model(module.model, str(folder / WEIGHTS_FILE))
    return module.eval()
