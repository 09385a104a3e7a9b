"""``SeqPackCLI``: the ``lit-seqpack`` LightningCLI, with the defaults and links that packed training needs.

What it adds to a plain ``LightningCLI``:

- ``${asset:...}`` (a data asset installed with the package) and ``${config_name:}`` (the ``--config`` file's name,
  which the shipped configs use for ``outputs/<config name>/``) are resolved in configs
  (:mod:`lit_seqpack.cli`);
- every subcommand parser runs in omegaconf mode: ``${...}`` in a YAML file is resolved when the file is loaded
  (against that file), and ``${...}`` given on the command line (``--trainer.default_root_dir '${oc.env:HOME}'``)
  against the whole merged config (settings typed as strings: paths, names; jsonargparse checks an int or a
  bool before any resolution); a ``${data.max_tokens}`` that a misspelt key leaves unresolved names the typo;
- ``trainer.use_distributed_sampler`` defaults to ``False``: the planner assigns every rank its own
  microbatches, and Lightning's ``DistributedSampler`` would re-split them and make ranks hang;
- ``data.vocab_size`` is linked to ``model.init_args.vocab_size`` when the model takes a ``vocab_size``
  (:class:`~lit_seqpack.model.lm.ReferenceLM`), so the vocabulary is written once, in the data section; it
  counts every id of the data (``input_ids`` and ``labels``) and ``data.pad_token_id``;
- the model's ``max_seq_len`` (when it takes one: :class:`~lit_seqpack.model.lm.ReferenceLM`) follows the longest
  row the data makes, ``data.eval_max_tokens`` (or ``data.max_tokens``), unless the config sets another value: the
  row length is one decision, written in the data section; a conflict between the lengths of the data, the budgets
  and the model is one setup error naming every setting and values that work
  (:meth:`~lit_seqpack.data.settings.BatchingSettings.length_conflict`);
- models whose vocabulary lives elsewhere (:class:`~lit_seqpack.model.lm.HFCausalLM`'s ``config`` dict or
  checkpoint) are checked after instantiation: a vocabulary smaller than the data's fails with a clear message;
- ``fit``, ``validate``, ``test`` and ``predict`` (``--output scores.jsonl``: every sample's log-probabilities, written
  by :class:`~lit_seqpack.prediction.PredictionWriter` from every rank and merged in index order);
- ``torch_num_threads`` sets torch's CPU thread pool from the config (a 2-core machine shared with other
  processes trains an order of magnitude faster with 1 thread than with torch's default of one per core);
- the saved ``config.yaml`` may overwrite the previous run's, so rerunning the demo just works.

The ``inspect`` (plan statistics without training), ``generate`` and ``export`` subcommands are dispatched by
:mod:`lit_seqpack.__main__`.

The CLI's config files: ``${...}`` resolved against the whole config, and a failed or misdirected one explained.

jsonargparse's omegaconf mode resolves ``${...}`` inside each YAML file as it is loaded; what it cannot (a typo behind
an interpolation, a bad data value reported at the model setting that interpolates it) is named here as the file
spells it.

The ``${asset:...}`` and ``${config_name:}`` interpolations of the shipped YAML configs.

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

import difflib
import importlib
import inspect
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
import yaml
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

from lit_seqpack._checks import check_int
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.settings import DEFAULT_MAX_TOKENS
from lit_seqpack.data.sources.text import vocab_hint
from lit_seqpack.model.hf_load import model_vocab_size

__all__ = [
    "DEFAULT_MODEL",
    "SUBCOMMANDS",
    "TRAINER_DEFAULTS",
    "ConfigError",
    "SeqPackArgumentParser",
    "SeqPackCLI",
    "check_vocab",
    "did_you_mean",
    "user_message",
    "model_vocab_size",
    "check_interpolated_data",
    "explain_interpolation_error",
    "resolve_interpolation",
    "ASSETS",
    "DEFAULT_RUN_NAME",
    "asset_path",
    "config_files",
    "register_resolvers",
    "run_name",
]


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
    # omegaconf 2.4 deprecates register_new_resolver for register_resolver, whose 2.3 form is the legacy one
    modern = "replace" in inspect.signature(OmegaConf.register_resolver).parameters
    register = OmegaConf.register_resolver if modern else OmegaConf.register_new_resolver
    register("asset", asset_path, replace=True)
    register("config_name", lambda: name, replace=True)


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


log = logging.getLogger(__name__)

DEFAULT_MODEL = "lit_seqpack.model.lm.ReferenceLM"
"""The model trained when the config names none."""

SUBCOMMANDS: dict[str, set[str]] = {
    "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
    "validate": {"model", "dataloaders", "datamodule"},
    "test": {"model", "dataloaders", "datamodule"},
    "predict": {"model", "dataloaders", "datamodule", "return_predictions"},
}
"""The Trainer methods exposed as subcommands, with the arguments the CLI fills itself."""

_DESCRIPTION = (
    "Train, validate and test language models on packed or dynamically batched sequences "
    "(lit-seqpack SUBCOMMAND --help for the options of each). "
    "Also: 'lit-seqpack inspect --config CONFIG.yaml [--plot FILE.png]' compares every batching mode "
    "and packing algorithm on the config's data without training; "
    "'lit-seqpack predict --config CONFIG.yaml --output scores.jsonl' writes every sample's log-probabilities; "
    "'lit-seqpack generate --ckpt_path CKPT --prompt TEXT' generates from a trained checkpoint; "
    "'lit-seqpack export --ckpt_path CKPT --output_dir DIR' writes it as a model folder (Hugging Face for HFCausalLM)."
)

TRAINER_DEFAULTS: dict[str, Any] = {"use_distributed_sampler": False}
"""Trainer defaults the samplers need (a config may still override them, and then the DataModule refuses)."""


def check_vocab(model: LightningModule, data_vocab_size: int, *, hint: str = "or lower the data's ids") -> None:
    """Fail before training when ``model`` cannot embed every token id of the data.

    Args:
        model: the LightningModule.
        data_vocab_size: the vocabulary the data needs (``SeqPackDataModule.vocab_size``).
        hint: the data-side fix, ending the message (:func:`~lit_seqpack.data.sources.text.vocab_hint`).

    Raises:
        ValueError: the model's vocabulary is smaller than the data's (the message names both values).
    """
    vocab = model_vocab_size(model)
    if vocab is None:
        log.info(
            "lit_seqpack: %s does not expose its vocab_size; the data needs %d ids",
            type(model).__name__,
            data_vocab_size,
        )
        return
    if vocab < data_vocab_size:
        raise ConfigError(
            f"the model's vocab_size={vocab} is smaller than the data's vocab_size={data_vocab_size}: token ids "
            f"up to {data_vocab_size - 1} would index past the embedding. Raise the model's vocab_size (for "
            f"HFCausalLM: model.init_args.config.vocab_size), {hint}"
        )


class ConfigError(ValueError):
    """A bad setting found while parsing or instantiating the config: ``lit-seqpack`` prints its message alone."""


_JSONARGPARSE_NOISE = (
    "Expected a ",
    "Import path ",
    "Not a valid ",
    "Type <",
    "does not correspond to a subclass",
    "does not implement protocol",
    "Given value",
)


def user_message(text: str) -> str:
    r"""The message of a setting's own error inside jsonargparse's account of a failed union (or the text itself).

    jsonargparse tries each type of a ``Union`` setting and lists every attempt's error; the one a lit_seqpack class
    (or the user's) raised is the one that says what is wrong. A parser error keeps the key it names.

    Example:
        >>> text = "Does not validate against any of the Union subtypes\nSubtypes: [...]\nErrors:\n"
        >>> text += "  - Expected a <class 'str'>\n  - tokenizer='x' is not a local folder\nGiven value: ..."
        >>> user_message(text)
        "tokenizer='x' is not a local folder"
        >>> user_message('Parser key "model":\n  Errors:\n    - Option \'n_layers\' is not accepted\n')
        "model: Option 'n_layers' is not accepted"
    """
    if "Errors:" not in text:
        return text
    items: list[list[str]] = []
    depth = -1  # the indentation of the current item's "- "; deeper lines continue it
    for line in text.split("Errors:", 1)[1].splitlines():
        item = re.match(r"^( {2,4})- (.*)", line)
        if item:
            items.append([item.group(2)])
            depth = len(item.group(1))
        elif depth >= 0 and line.startswith(" " * (depth + 3)) and line.strip():
            items[-1].append(line.strip())
        else:
            depth = -1
    errors = [" ".join(parts) for parts in items]
    own = [error for error in errors if error and not any(noise in error for noise in _JSONARGPARSE_NOISE)]
    if not own:
        return text
    key = re.match(r'^Parser key "([^"]+)":', text)
    return (f"{key.group(1)}: " if key else "") + "\n".join(own)


def did_you_mean(message: str, options: list[str]) -> str:
    """``message`` with the closest known keys of each unknown one (``--data.max_token`` -> ``--data.max_tokens``).

    Unknown keys are read from argparse's ``unrecognized arguments: ...`` (the command line), jsonargparse's
    ``does not accept option '...'`` (a config file; ``nested key`` before jsonargparse 4.5x) and ``Option '...' is
    not accepted`` of a ``class_path`` (its ``init_args``: the class's own parameters are the known keys; ``Key '...'
    is not expected`` before 4.5x).

    Example:
        >>> did_you_mean("unrecognized arguments: --data.max_token 5", ["--data.max_tokens", "--data.mode"])
        'unrecognized arguments: --data.max_token 5 (did you mean --data.max_tokens?)'
        >>> did_you_mean("Subcommand 'fit' does not accept option 'data.val_fractio'", ["--data.val_fraction"])
        "Subcommand 'fit' does not accept option 'data.val_fractio' (did you mean data.val_fraction?)"
        >>> did_you_mean("model: class_path 'lit_seqpack.ReferenceLM': Option 'n_layers' is not accepted", [])
        "model: class_path 'lit_seqpack.ReferenceLM': Option 'n_layers' is not accepted (did you mean n_layer?)"
        >>> did_you_mean("class_path 'lit_seqpack.ReferenceLM': Key 'n_layers' is not expected", [])
        "class_path 'lit_seqpack.ReferenceLM': Key 'n_layers' is not expected (did you mean n_layer?)"
    """
    unknown = [(word.split("=", 1)[0], "--") for word in message.split() if word.startswith("--")]
    if "unrecognized arguments" not in message.lower():
        unknown = [(key, "") for key in re.findall(r"does not accept (?:option|nested key) '([^']+)'", message)]
    hints = []
    unaccepted = r"class_path '([\w.]+)':? (?:Validation failed: )?(?:Option|Key) '(\w+)' is not (?:accepted|expected)"
    for class_path, name in re.findall(unaccepted, message):
        try:
            accepted = [key for key in _parameters(_import_class(class_path)) if key not in ("self", "args", "kwargs")]
        except (ImportError, AttributeError, ValueError, TypeError):
            continue
        close = difflib.get_close_matches(name, accepted, n=3, cutoff=0.8)
        if close:
            hints.append(f"did you mean {' or '.join(close)}?")
    for key, prefix in unknown:
        names = [option[2:] if not prefix and option.startswith("--") else option for option in options]
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.8)
        if close:
            hints.append(f"did you mean {' or '.join(close)}?")
    return f"{message} ({'; '.join(hints)})" if hints else message


class SeqPackArgumentParser(LightningArgumentParser):
    """The CLI's parser: no abbreviated keys (``--data.max_token`` is refused, not read as ``--data.max_tokens``), and
    an error is its message alone (with the closest keys of an unknown one), not the usage of every option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self._named_subcommand(message) or self
        options = [option for action in parser._actions for option in action.option_strings]
        message = did_you_mean(user_message(message), options)
        if not self.exit_on_error:  # jsonargparse's own ArgumentError, which its internal parsers catch
            super().error(message, ex)
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"{prog}: error: {message}\n(all the options: {prog} --help)\n")
        self.exit(2)

    def _named_subcommand(self, message: str) -> Any:
        """The parser of the subcommand a message names (``Subcommand 'fit' ...``), whose options are the known keys
        (jsonargparse < 4.5x does not attach it to the error)."""
        match = re.search(r"Subcommand '(\w+)'", message)
        action = getattr(self, "_subcommands_action", None)
        return action._name_parser_map.get(match.group(1)) if match and action is not None else None


class SeqPackCLI(LightningCLI):
    """The ``lit-seqpack`` command line: ``fit``, ``validate``, ``test`` and ``predict`` of a packed LightningModule.

    The model is any LightningModule given by ``class_path`` (``ReferenceLM`` by default, ``HFCausalLM``, or
    your own with :class:`~lit_seqpack.model.mixin.PackedSequenceMixin`); the data is a
    :class:`~lit_seqpack.data.datamodule.SeqPackDataModule` (or a subclass passed as ``datamodule_class``).

    Args:
        model_class: the base class of the models accepted under ``model:`` (subclasses by ``class_path``).
        datamodule_class: the DataModule class whose arguments form the ``data:`` section.
        args: arguments to parse instead of ``sys.argv`` (a list, or a dict of the whole config).
        run: run the subcommand (``False``: only instantiate the model, data and trainer, without subcommand).
        **kwargs: other :class:`~lightning.pytorch.cli.LightningCLI` arguments; ``parser_kwargs``,
            ``trainer_defaults`` and ``save_config_kwargs`` are merged over this CLI's defaults.

    Example::

        lit-seqpack fit --config configs/demo.yaml --trainer.max_steps 50
    """

    def __init__(
        self,
        model_class: type[LightningModule] = LightningModule,
        datamodule_class: type[SeqPackDataModule] = SeqPackDataModule,
        *,
        args: Any = None,
        run: bool = True,
        **kwargs: Any,
    ) -> None:
        parser_kwargs = {
            "parser_mode": "omegaconf",
            "prog": "lit-seqpack",
            "description": _DESCRIPTION,
            **{name: {"parser_mode": "omegaconf"} for name in SUBCOMMANDS},
            **kwargs.pop("parser_kwargs", {}),
        }
        trainer_defaults = {**TRAINER_DEFAULTS, **kwargs.pop("trainer_defaults", {})}
        save_config_kwargs = {"overwrite": True, **kwargs.pop("save_config_kwargs", {})}
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("parser_class", SeqPackArgumentParser)
        super().__init__(
            model_class,
            datamodule_class,
            parser_kwargs=parser_kwargs,
            trainer_defaults=trainer_defaults,
            save_config_kwargs=save_config_kwargs,
            args=args,
            run=run,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate``, ``test`` and ``predict``, with the Trainer arguments the CLI fills itself."""
        return {name: set(skip) for name, skip in SUBCOMMANDS.items()}

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse; resolve the ``${...}`` left in the subcommand's merged config; name the key behind a failed one.

        jsonargparse's omegaconf mode resolves interpolation inside each YAML file as it is loaded, but leaves a
        ``${...}`` given on the command line as a plain string (``--trainer.default_root_dir '${oc.env:HOME}'`` made
        a folder of that name): it is resolved here, against the whole config of the subcommand.
        """
        from omegaconf.errors import InterpolationResolutionError

        register_resolvers(sys.argv[1:] if args is None else args)
        check_interpolated_data(sys.argv[1:] if args is None else args)
        try:
            super().parse_arguments(parser, args)
        except InterpolationResolutionError as err:
            raise ConfigError(explain_interpolation_error(err, sys.argv[1:] if args is None else args)) from None
        subcommand = self.config.get("subcommand")
        try:
            if subcommand is None:  # run=False: one parser, no subcommand
                if "${" in str(self.config):
                    self.config = resolve_interpolation(parser, self.config)
            elif "${" in str(self.config[subcommand]):
                subparser = self._subcommand_parsers[subcommand]
                self.config[subcommand] = resolve_interpolation(subparser, self.config[subcommand])
        except ValueError as err:  # a ${...} that does not resolve: its message alone
            raise ConfigError(str(err)) from None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Add ``torch_num_threads``; link the data's vocabulary to the model's (once the DataModule exists)."""
        parser.add_argument(
            "--torch_num_threads",
            type=int | None,
            default=None,
            help="CPU threads of torch's intra-op pool (torch.set_num_threads) in every process; null leaves "
            "torch's default. 1 is the fastest on a small machine shared with other work.",
        )
        parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})
        parser.link_arguments("data.vocab_size", "model.init_args.vocab_size", apply_on="instantiate")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand == "predict":
            parser.add_argument(
                "--output",
                type=str | None,
                default=None,
                help="the predictions file, .jsonl or .parquet: one record per sample (index, token_logprobs, nll, "
                "num_loss_tokens), every rank's merged in index order (default: <trainer.default_root_dir>/"
                "predictions.jsonl)",
            )
        return parser

    def predict(self, model: LightningModule, datamodule: Any = None, **kwargs: Any) -> None:
        """``trainer.predict`` with a :class:`~lit_seqpack.prediction.PredictionWriter` writing ``--output``."""
        from lit_seqpack.prediction import PredictionWriter

        output = self.config["predict"].get("output")
        if output is None:
            output = str(Path(self.trainer.default_root_dir) / "predictions.jsonl")
        writer = PredictionWriter(output)
        self.trainer.callbacks.append(writer)
        self.trainer.predict(model, datamodule=datamodule, return_predictions=False, **kwargs)
        rank_zero_info(f"lit-seqpack predict: {writer.merged} predictions (every rank's) written to {output}")

    def before_fit(self) -> None:
        """``--ckpt_path last`` with several ``last*.ckpt`` in the checkpoint folder: say which one resumes and why."""
        if self.config["fit"].get("ckpt_path") != "last":
            return
        from lightning.pytorch.callbacks import ModelCheckpoint

        found: set[str] = set()
        for callback in self.trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                found |= {str(path) for path in Path(callback.dirpath).glob("last*.ckpt")}
        if len(found) > 1:
            newest = max(found, key=lambda path: Path(path).stat().st_mtime)
            others = ", ".join(sorted(Path(path).name for path in found - {newest}))
            rank_zero_info(
                f"lit-seqpack: --ckpt_path last resumes {newest}, the newest of the folder's last*.ckpt (also there: "
                f"{others}, from other runs of this config); pass a file to --ckpt_path to resume another"
            )

    def before_test(self) -> None:
        """Fail with an explanation when the DataModule has no test split (Lightning's message names no fix)."""
        data = self.datamodule
        if data is not None and type(data).test_dataloader is LightningDataModule.test_dataloader:
            raise ValueError(
                f"{type(data).__name__} defines no test_dataloader, so `lit-seqpack test` has no data: evaluate the "
                "held-out split with `lit-seqpack validate` (data.val_fraction > 0), or use SeqPackDataModule with "
                "data.test_fraction > 0"
            )

    def before_instantiate_classes(self) -> None:
        """Apply ``torch_num_threads``; remember the model's configured ``vocab_size`` (the link replaces it)."""
        threads = self._get(self.config, "torch_num_threads")
        if threads is not None:
            torch.set_num_threads(check_int("torch_num_threads (null: torch's default)", threads, minimum=1))
        init_args = self._get(self.config, "model").get("init_args")
        self._configured_vocab = None if init_args is None else init_args.get("vocab_size")
        self._link_row_length(init_args)

    def _link_row_length(self, init_args: Any) -> None:
        """``model.init_args.max_seq_len`` := the longest row of the data (``eval_max_tokens``, else ``max_tokens``)
        when the model takes one and the config leaves it at the model's default."""
        model_class = self._get(self.config, "model").get("class_path")
        if init_args is None or model_class is None or not _accepts_named(_import_class(model_class), _ROW_KEY):
            return
        data = self._get(self.config, "data")
        budgets = [data.get("max_tokens"), data.get("eval_max_tokens")]
        if data.get("max_tokens") == "auto" and data.get("mode", "packing") != "padded":
            budgets[0] = DEFAULT_MAX_TOKENS
        rows = [value for value in budgets if isinstance(value, int) and not isinstance(value, bool)]
        if not rows or init_args.get(_ROW_KEY) not in (None, _default_of(_import_class(model_class), _ROW_KEY)):
            return  # no token budget (padded batches), or set in the config: the setup check compares it
        init_args[_ROW_KEY] = max(rows)

    def instantiate_classes(self) -> None:
        """Instantiate; a setting's own error inside jsonargparse's account of a union is raised alone."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            message = user_message(str(err))
            if message == str(err):
                raise
            raise ConfigError(message) from None

    def after_instantiate_classes(self) -> None:
        """Check the vocabulary: set once (in the data), and large enough for every token id of the data.

        A run without a logger (``--trainer.logger false``) drops the config's ``LearningRateMonitor`` (it refuses
        to run without one) instead of failing at the start of fit.
        """
        trainer = getattr(self, "trainer", None)
        if trainer is not None and not trainer.loggers:
            from lightning.pytorch.callbacks import LearningRateMonitor

            kept = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
            if len(kept) < len(trainer.callbacks):
                log.info("lit_seqpack: no logger, so the config's LearningRateMonitor is left out")
                trainer.callbacks = kept
        if self.datamodule is None or self.model is None:
            return
        data_vocab = self.datamodule.vocab_size
        accepted = _accepts(type(self.model), _VOCAB_KEY)
        if not accepted:
            # LightningCLI records a linked value in hparams even when the model has no such parameter; a
            # checkpoint would then pass it back to __init__ on resume or load_from_checkpoint
            _drop_hparam(self.model, _VOCAB_KEY)
        # switching --model away from the default model keeps the init_args of the same name (jsonargparse): the
        # default model's vocab_size default then arrives without the user typing it
        carried = _default_of(_import_class(DEFAULT_MODEL), _VOCAB_KEY)
        defaults = (_default_of(type(self.model), _VOCAB_KEY), carried, data_vocab)
        configured = self._configured_vocab
        if accepted and configured is not None and configured not in defaults:
            raise ConfigError(
                f"model.init_args.vocab_size={configured} is set twice: the CLI links it to data.vocab_size="
                f"{data_vocab}. Remove it from the model section (the data decides the vocabulary)"
            )
        check_vocab(self.model, data_vocab, hint=vocab_hint(getattr(self.datamodule, "source", None)))


_VOCAB_KEY = "vocab_size"
_ROW_KEY = "max_seq_len"


def _parameters(cls: type) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(cls.__init__).parameters


def _accepts(cls: type, name: str) -> bool:
    params = _parameters(cls)
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _accepts_named(cls: type, name: str) -> bool:
    return name in _parameters(cls)


def _default_of(cls: type, name: str) -> Any:
    param = _parameters(cls).get(name)
    return None if param is None or param.default is inspect.Parameter.empty else param.default


def _import_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _drop_hparam(model: LightningModule, name: str) -> None:
    model.hparams.pop(name, None)
    initial = getattr(model, "_hparams_initial", None)
    if initial is not None:
        initial.pop(name, None)
