"""Reading a trained Lightning checkpoint back: its LightningModule class, the module, and its tokenizer.

``lit-seqpack generate`` and ``lit-seqpack export`` load whatever a ``fit`` run saved: the class is the one the CLI
recorded in the checkpoint (``hyper_parameters._class_path``), imported only when it is one of lit_seqpack's own
models (a checkpoint is data; importing a module it names would run that module's code), else named by the user.
"""

from __future__ import annotations

import importlib
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lit_seqpack.data.datamodule import TOKENIZER_STATE

__all__ = ["TRUSTED_MODELS", "checkpoint_tokenizer", "import_class", "load_checkpoint", "load_module"]

TRUSTED_MODELS = ("lit_seqpack.model.lm.ReferenceLM", "lit_seqpack.model.lm.HFCausalLM")
"""The classes a checkpoint may name without ``--model_class``."""

_ALIASES = {"lit_seqpack.ReferenceLM": TRUSTED_MODELS[0], "lit_seqpack.HFCausalLM": TRUSTED_MODELS[1]}


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint's dict, on the CPU.

    Raises:
        FileNotFoundError: no such file (the message says where checkpoints of the shipped configs are).
        ValueError: the file is not a readable checkpoint (truncated, overwritten, another format), named.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--ckpt_path {path}: no such file (the shipped configs keep checkpoints in "
            "outputs/<config name>/checkpoints/, last.ckpt the newest)"
        )
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive (an older pickle file starts with 0x80)
        with path.open("rb") as handle:
            if handle.read(1) != b"\x80":
                raise ValueError(
                    f"--ckpt_path {path}: not a readable checkpoint (neither a torch.save zip archive nor a pickle); "
                    "the file is corrupt or not a Lightning checkpoint (a truncated copy, another format)"
                )
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"--ckpt_path {path}: not a readable checkpoint ({type(err).__name__}: {err})") from err
    except RuntimeError as err:
        if "PytorchStreamReader" not in str(err):
            raise
        raise ValueError(f"--ckpt_path {path}: not a readable checkpoint (a corrupt torch archive: {err})") from err


def import_class(path: str) -> type:
    """The class at ``module.Class``; a ``ValueError`` names a path that does not import."""
    module_name, _, class_name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"--model_class {path!r} does not import ({err})") from None


def _module_class(checkpoint: Mapping[str, Any], model_class: str | None, ckpt_path: str | Path) -> type:
    if model_class is not None:
        return import_class(model_class)
    hparams = checkpoint.get("hyper_parameters", {})
    recorded = hparams.get("_class_path")
    recorded = _ALIASES.get(recorded, recorded)
    if recorded in TRUSTED_MODELS:
        return import_class(recorded)
    if recorded is None:
        inferred = _by_hyperparameters(hparams)
        if inferred is not None:
            return inferred
        raise ValueError(
            f"{ckpt_path} does not record its LightningModule class (it was not saved by `lit-seqpack fit`) and its "
            "hyperparameters are neither ReferenceLM's nor HFCausalLM's: pass --model_class module.Class"
        )
    raise ValueError(
        f"{ckpt_path} was trained with {recorded}, which is not one of lit_seqpack's models {TRUSTED_MODELS}: if you "
        f"trust the checkpoint, pass --model_class {recorded}"
    )


def _by_hyperparameters(hparams: Mapping[str, Any]) -> type | None:
    """The trusted model whose constructor takes exactly these hyperparameters (a checkpoint saved from Python)."""
    import inspect

    names = {key for key in hparams if not key.startswith("_")}
    for path in TRUSTED_MODELS:
        cls = import_class(path)
        if names and names <= set(inspect.signature(cls.__init__).parameters) - {"self"}:
            return cls
    return None


def load_module(ckpt_path: str | Path, *, model_class: str | None = None) -> LightningModule:
    """The trained LightningModule of a checkpoint, on the CPU, in eval mode.

    Args:
        ckpt_path: a Lightning checkpoint.
        model_class: ``module.Class`` of the module (default: the class the CLI recorded, if it is one of
            :data:`TRUSTED_MODELS`).

    Raises:
        ValueError: the class is unknown or untrusted (the message says how to name it).
    """
    checkpoint = load_checkpoint(ckpt_path)
    cls = _module_class(checkpoint, model_class, ckpt_path)
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise ValueError(f"--model_class {model_class} is not a LightningModule subclass")
    module = cls.load_from_checkpoint(ckpt_path, map_location="cpu", weights_only=False)
    return module.eval()


def checkpoint_tokenizer(checkpoint: Mapping[str, Any]) -> str | None:
    """The tokenizer folder a run trained with: its data source's (recorded by ``SeqPackDataModule``), else the
    ``model_name_or_path`` folder of an ``HFCausalLM`` when it holds tokenizer files; ``None`` without one."""
    for value in checkpoint.values():
        if isinstance(value, Mapping) and isinstance(value.get(TOKENIZER_STATE), str):
            return value[TOKENIZER_STATE]
    name = checkpoint.get("hyper_parameters", {}).get("model_name_or_path")
    if isinstance(name, str) and Path(name).is_dir():
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if any((Path(name) / file).exists() for file in files):
            return name
    return None
