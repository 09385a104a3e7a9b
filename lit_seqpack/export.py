"""``lit-seqpack export``: a trained checkpoint as a model folder that loads without Lightning.

::

    lit-seqpack export --ckpt_path outputs/hf_llama/checkpoints/last.ckpt --output_dir outputs/hf_llama/hf
    lit-seqpack export --ckpt_path outputs/text_sft/checkpoints/last.ckpt --output_dir outputs/text_sft/model

The Lightning checkpoint is loaded on the CPU as the class it recorded (:mod:`lit_seqpack.export`).

- :class:`~lit_seqpack.model.lm.HFCausalLM`: a Hugging Face folder (the base model named by its
  ``model_name_or_path`` must still be readable: the module is rebuilt from its hyperparameters, then gets the trained
  weights); PEFT adapters are merged and the stock attention implementation is restored, so
  ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads the trained model with no lit_seqpack installed. The same
  in Python: ``HFCausalLM.export_hf(path)``.
- :class:`~lit_seqpack.model.lm.ReferenceLM`: a plain folder, ``config.json`` (its constructor arguments) and
  ``model.safetensors``, that :func:`~lit_seqpack.model.lm.load_reference_lm` loads.

The tokenizer the run trained with (or ``--tokenizer``) is saved alongside.

Reading a trained Lightning checkpoint back: its LightningModule class, the module, and its tokenizer.

``lit-seqpack generate`` and ``lit-seqpack export`` load whatever a ``fit`` run saved: the class is the one the CLI
recorded in the checkpoint (``hyper_parameters._class_path``), imported only when it is one of lit_seqpack's own
models (a checkpoint is data; importing a module it names would run that module's code), else named by the user.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule

from lit_seqpack.data.datamodule import TOKENIZER_STATE

__all__ = [
    "build_export_parser",
    "export_command",
    "TRUSTED_MODELS",
    "checkpoint_tokenizer",
    "import_class",
    "load_checkpoint",
    "load_module",
]


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


def build_export_parser() -> argparse.ArgumentParser:
    """The ``lit-seqpack export`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="lit-seqpack export",
        description="Write a trained checkpoint as a model folder: Hugging Face for HFCausalLM (adapters merged, "
        "stock attention restored), config.json + model.safetensors for ReferenceLM.",
    )
    parser.add_argument("--ckpt_path", required=True, help="a Lightning checkpoint of an HFCausalLM or a ReferenceLM")
    parser.add_argument("--output_dir", required=True, help="the folder to write (save_pretrained layout)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="saved weights (default: as trained)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer to save alongside (default: the one the run trained with)"
    )
    parser.add_argument(
        "--model_class",
        default=None,
        help="the checkpoint's LightningModule class as module.Class (default: the class the run recorded)",
    )
    return parser


def export_command(argv: Sequence[str]) -> str:
    """Run ``lit-seqpack export`` with ``argv`` (after the word ``export``); return a one-line report.

    Raises:
        ValueError: a checkpoint of a model that has no export (the message says what to do instead).
    """
    from lit_seqpack.model.lm import ReferenceLM, save_reference_lm

    args = build_export_parser().parse_args(list(argv))
    module = load_module(args.ckpt_path, model_class=args.model_class)
    tokenizer = args.tokenizer or checkpoint_tokenizer(load_checkpoint(args.ckpt_path))
    if hasattr(module, "export_hf"):
        path = module.export_hf(args.output_dir, dtype=args.dtype, tokenizer=tokenizer)
        model = module.model
        peft = hasattr(model, "get_base_model")
        name = type(model.get_base_model()).__name__ + " (PEFT adapters merged)" if peft else type(model).__name__
        return f"exported {name} from {args.ckpt_path} to {path} (AutoModelForCausalLM.from_pretrained loads it)"
    if isinstance(module, ReferenceLM):
        path = save_reference_lm(module, args.output_dir, dtype=args.dtype, tokenizer=tokenizer)
        return (
            f"exported ReferenceLM from {args.ckpt_path} to {path} (config.json + model.safetensors"
            f"{' + tokenizer' if tokenizer else ''}; lit_seqpack.model.lm.load_reference_lm loads it)"
        )
    raise ValueError(
        f"{type(module).__name__} has no export: give it an export_hf(path, dtype=..., tokenizer=...) method, or save "
        "module.state_dict() yourself (the Lightning checkpoint already holds it under 'state_dict')"
    )
