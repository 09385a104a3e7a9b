"""``lit-seqpack export``: a trained :class:`~lit_seqpack.model.lm.HFCausalLM` checkpoint as a Hugging Face folder.

::

    lit-seqpack export --ckpt_path outputs/run/checkpoints/last.ckpt --output_dir outputs/run/hf [--dtype bfloat16]

The Lightning checkpoint is loaded on the CPU (the base model named by its ``model_name_or_path`` must still be
readable: the module is rebuilt from its hyperparameters, then gets the trained weights), PEFT adapters are merged
and the stock attention implementation is restored (the base checkpoint's tokenizer, if its folder has one, or
``--tokenizer`` is saved alongside), so ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads
the trained model with no lit_seqpack installed. The same in Python: ``HFCausalLM.export_hf(path)``.
"""

from __future__ import annotations

import argparse
import importlib
import pickle
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_export_parser", "export_command"]


def build_export_parser() -> argparse.ArgumentParser:
    """The ``lit-seqpack export`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="lit-seqpack export",
        description="Write a trained HFCausalLM checkpoint as a Hugging Face model folder (adapters merged, "
        "stock attention restored).",
    )
    parser.add_argument("--ckpt_path", required=True, help="a Lightning checkpoint of an HFCausalLM")
    parser.add_argument("--output_dir", required=True, help="the folder to write (save_pretrained layout)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="saved weights (default: as trained)"
    )
    parser.add_argument(
        "--tokenizer", default=None, help="a tokenizer to save alongside (default: the base checkpoint's, if any)"
    )
    parser.add_argument(
        "--model_class",
        default="lit_seqpack.model.lm.HFCausalLM",
        help="the checkpoint's LightningModule class (an HFCausalLM subclass), as module.Class",
    )
    return parser


def export_command(argv: Sequence[str]) -> str:
    """Run ``lit-seqpack export`` with ``argv`` (after the word ``export``); return a one-line report."""
    args = build_export_parser().parse_args(list(argv))
    module_name, _, class_name = args.model_class.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not hasattr(cls, "export_hf"):
        raise ValueError(f"--model_class {args.model_class} has no export_hf method (use HFCausalLM or a subclass)")
    module = _load_checkpoint(cls, args.ckpt_path)
    path = module.export_hf(args.output_dir, dtype=args.dtype, tokenizer=args.tokenizer)
    model = module.model
    name = type(model.get_base_model()).__name__ + " (PEFT adapters merged)" if hasattr(model, "get_base_model") else ""
    return f"exported {name or type(model).__name__} from {args.ckpt_path} to {path}"


def _load_checkpoint(cls: Any, ckpt_path: str) -> Any:
    """``cls.load_from_checkpoint(ckpt_path)`` on the CPU; a file that is not a readable checkpoint is named.

    Raises:
        ValueError: ``ckpt_path`` is missing, not a ``torch.save`` archive, or a corrupt one (truncated, overwritten).
    """
    path = Path(ckpt_path)
    if not path.is_file():
        raise ValueError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive (an older pickle file starts with 0x80)
        with path.open("rb") as handle:
            if handle.read(1) != b"\x80":
                raise ValueError(
                    f"--ckpt_path {ckpt_path}: not a readable checkpoint (neither a torch.save zip archive nor a "
                    "pickle); the file is corrupt or not a Lightning checkpoint (a truncated copy, another format)"
                )
    try:
        return cls.load_from_checkpoint(ckpt_path, map_location="cpu")
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile) as err:
        raise ValueError(f"--ckpt_path {ckpt_path}: not a readable checkpoint ({type(err).__name__})") from err
    except RuntimeError as err:
        if "PytorchStreamReader" not in str(err):  # a model error (e.g. state_dict keys), not the file's
            raise
        raise ValueError(f"--ckpt_path {ckpt_path}: not a readable checkpoint (a corrupt torch archive)") from err
