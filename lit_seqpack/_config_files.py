"""The CLI's config files: ``${...}`` resolved against the whole config, and a failed or misdirected one explained.

jsonargparse's omegaconf mode resolves ``${...}`` inside each YAML file as it is loaded; what it cannot (a typo behind
an interpolation, a bad data value reported at the model setting that interpolates it) is named here as the file
spells it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any

import yaml
from lightning.pytorch.cli import LightningArgumentParser

from lit_seqpack.config_resolvers import config_files

__all__ = ["check_interpolated_data", "explain_interpolation_error", "resolve_interpolation"]


def resolve_interpolation(parser: LightningArgumentParser, cfg: Any) -> Any:
    """``cfg`` with every ``${...}`` resolved by omegaconf against the whole config."""
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError

    dumped = parser.dump(cfg, skip_validation=True, skip_link_targets=False)
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(yaml.safe_load(dumped)), resolve=True)
    except InterpolationResolutionError as err:
        raise ValueError(f"cannot resolve the interpolation in {err.full_key}: {err.msg}") from None
    return parser.parse_object(resolved)


def explain_interpolation_error(err: Exception, args: Any) -> str:
    """A message for a ``${a.b}`` that a YAML file cannot resolve, naming the unknown key it sets instead (a typo).

    Args:
        err: omegaconf's error (``Interpolation key 'data.max_tokens' not found``).
        args: the command line, to find the ``--config`` files.
    """
    text = str(err).splitlines()[0]
    match = re.search(r"Interpolation key '([^']+)' not found", text)
    where = getattr(err, "full_key", None)
    message = f"the config's interpolation in {where or 'a value'} failed: {text}"
    if match is None:
        return message
    missing = match.group(1)
    parent, _, leaf = missing.rpartition(".")
    for path in config_files(args):
        section: Any = _load_yaml(path)
        for part in parent.split(".") if parent else []:
            section = section.get(part) if isinstance(section, Mapping) else None
            if isinstance(section, Mapping) and "init_args" in section and part != "init_args":
                section = section if leaf in section else section.get("init_args", section)
        if isinstance(section, Mapping):
            close = difflib.get_close_matches(leaf, [str(k) for k in section], n=1)
            if close:
                return (
                    f"{path}: {where or 'a value'} refers to ${{{missing}}}, but the file sets "
                    f"{parent + '.' if parent else ''}{close[0]}, not {leaf}: is {close[0]!r} a typo of {leaf!r}?"
                )
    return f"{message}; set {missing} in the config (or fix the name in the ${{...}})"


_DATA_REFERENCE = re.compile(r"^\$\{data\.(\w+)\}$")


def check_interpolated_data(args: Any) -> None:
    """Check the data settings a config's model section refers to (``max_seq_len: ${data.max_tokens}``) first.

    jsonargparse checks the model section before the data section, so a bad ``data.max_tokens`` would be reported
    as the model's ``max_seq_len`` (the interpolation's target): it is checked here and named as the file spells it.

    Args:
        args: the command line, to find the ``--config`` files.

    Raises:
        ValueError: naming the file, ``data.<key>``, its value, the rule, and the model setting that refers to it.
    """
    from dataclasses import fields

    from lit_seqpack.data.settings import BatchingSettings

    known = {field.name for field in fields(BatchingSettings)}
    for path in config_files(args):
        config = _load_yaml(path)
        if not isinstance(config, Mapping):
            continue
        model, data = (_init_args(config.get(name)) for name in ("model", "data"))
        for name, value in model.items():
            match = _DATA_REFERENCE.match(value) if isinstance(value, str) else None
            key = match.group(1) if match else None
            if key not in known or key not in data:
                continue
            try:
                BatchingSettings(**{key: data[key]})
            except (TypeError, ValueError) as err:
                if key not in str(err):  # the value is fine alone: the DataModule names the combination
                    continue
                raise ValueError(
                    f"{path}: data.{key}={data[key]!r} is not valid ({err}); model.init_args.{name} refers to it "
                    f"as ${{data.{key}}}, so fix data.{key}"
                ) from err


def _init_args(section: Any) -> Mapping[str, Any]:
    """A config section's arguments: its ``init_args`` under a ``class_path``, else the section itself."""
    if not isinstance(section, Mapping):
        return {}
    inner = section.get("init_args") if "class_path" in section else section
    return inner if isinstance(inner, Mapping) else {}


def _load_yaml(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except (OSError, yaml.YAMLError):
        return None
