"""The ``${asset:...}`` and ``${config_name:}`` interpolations of the shipped YAML configs.

The CLI (``fit``, ``validate``, ``test``, ``inspect``) registers them with omegaconf before it reads a config, so
a config runs from any working directory and writes under its own name:

- ``${asset:chat_demo/tokenizer}`` is the absolute path of a data asset installed with the package
  (``lit_seqpack/data/assets/...``), wherever the command runs from;
- ``${config_name:}`` is the file name, without suffix, of the last ``--config`` given on the command line
  (``configs/text_sft.yaml`` -> ``text_sft``): a copy of a shipped config saved as ``my_run.yaml`` logs to
  ``outputs/my_run/`` and keeps its checkpoints in ``outputs/my_run/checkpoints/``, where ``--ckpt_path last``
  finds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["ASSETS", "DEFAULT_RUN_NAME", "asset_path", "config_files", "register_resolvers", "run_name"]

ASSETS = Path(__file__).resolve().parent / "data" / "assets"
"""The folder of the data assets installed with the package."""

DEFAULT_RUN_NAME = "lit_seqpack"
"""``${config_name:}`` when no ``--config`` file is given."""


def asset_path(relative: str) -> str:
    """The absolute path of an installed data asset.

    Args:
        relative: the asset's path under ``lit_seqpack/data/assets/``.

    Raises:
        ValueError: no such asset (the message lists the assets there are).

    Example:
        >>> Path(asset_path("chat_demo/tokenizer")).is_dir()
        True
    """
    path = (ASSETS / str(relative)).resolve()
    if ASSETS not in path.parents or not path.exists():
        known = ", ".join(sorted(p.name for p in ASSETS.iterdir()))
        raise ValueError(f"${{asset:{relative}}}: no such asset under {ASSETS} (there are: {known})")
    return str(path)


def config_files(args: Sequence[object] | None) -> list[str]:
    """The ``--config`` / ``-c`` files of a command line, in order.

    Example:
        >>> config_files(["fit", "--config", "a.yaml", "--config=b.yaml", "--trainer.max_steps", "3"])
        ['a.yaml', 'b.yaml']
    """
    if not isinstance(args, (list, tuple)):
        return []
    files = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            files.append(str(args[i + 1]))
        elif isinstance(arg, str) and arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def run_name(args: Sequence[object] | None) -> str:
    """The run's name: the stem of the last ``--config`` file, else :data:`DEFAULT_RUN_NAME`.

    Example:
        >>> run_name(["fit", "--config", "configs/text_sft.yaml"]), run_name(["fit"])
        ('text_sft', 'lit_seqpack')
    """
    files = config_files(args)
    return Path(files[-1]).stem if files else DEFAULT_RUN_NAME


def register_resolvers(args: Sequence[object] | None) -> None:
    """Register ``asset`` and ``config_name`` with omegaconf for the command line ``args`` (replacing earlier ones)."""
    from omegaconf import OmegaConf

    name = run_name(args)
    OmegaConf.register_new_resolver("asset", asset_path, replace=True)
    OmegaConf.register_new_resolver("config_name", lambda: name, replace=True)
