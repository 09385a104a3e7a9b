"""``lit-seqpack export``: a trained checkpoint as a model folder that loads without Lightning.

::

    lit-seqpack export --ckpt_path outputs/hf_llama/checkpoints/last.ckpt --output_dir outputs/hf_llama/hf
    lit-seqpack export --ckpt_path outputs/text_sft/checkpoints/last.ckpt --output_dir outputs/text_sft/model

The Lightning checkpoint is loaded on the CPU as the class it recorded (:mod:`lit_seqpack.checkpoints`).

- :class:`~lit_seqpack.model.lm.HFCausalLM`: a Hugging Face folder (the base model named by its
  ``model_name_or_path`` must still be readable: the module is rebuilt from its hyperparameters, then gets the trained
  weights); PEFT adapters are merged and the stock attention implementation is restored, so
  ``AutoModelForCausalLM.from_pretrained(output_dir)`` loads the trained model with no lit_seqpack installed. The same
  in Python: ``HFCausalLM.export_hf(path)``.
- :class:`~lit_seqpack.model.lm.ReferenceLM`: a plain folder, ``config.json`` (its constructor arguments) and
  ``model.safetensors``, that :func:`~lit_seqpack.model.lm.load_reference_lm` loads.

The tokenizer the run trained with (or ``--tokenizer``) is saved alongside.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lit_seqpack.checkpoints import checkpoint_tokenizer, load_checkpoint, load_module

__all__ = ["build_export_parser", "export_command"]


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
