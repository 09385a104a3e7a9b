"""The ``lit-seqpack`` command (also ``python -m lit_seqpack``).

::

    lit-seqpack fit --config configs/demo.yaml               # train (LightningCLI: also validate, test, predict)
    lit-seqpack predict --config configs/demo.yaml --output scores.jsonl   # every sample's log-probabilities
    lit-seqpack fit --config configs/demo.yaml --ckpt_path last      # resume outputs/demo/checkpoints/last.ckpt
    lit-seqpack inspect --config configs/demo.yaml --plot plan.png   # compare every mode, no training
    lit-seqpack export --ckpt_path last.ckpt --output_dir model_dir  # a plain or Hugging Face model folder
    lit-seqpack generate --ckpt_path last.ckpt --prompt "..."        # text through a trained checkpoint

``inspect`` reads the ``data`` section of the same YAML (``--data.*`` overrides it) and the layout of its
``trainer`` section (``--world_size`` and ``--accumulate_grad_batches`` override it), plans one epoch of the
training split with every packing algorithm, dynamic batching and the padded baseline, and prints a table.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from lit_seqpack._checks import check_int
from lit_seqpack.cli import register_resolvers

if TYPE_CHECKING:
    from lit_seqpack.parallel import DataParallelLayout

__all__ = ["build_inspect_parser", "inspect_command", "main"]

# top-level keys of a `lit-seqpack fit` config that inspect accepts and ignores
_FIT_ONLY_KEYS = (
    "model",
    "optimizer",
    "lr_scheduler",
    "seed_everything",
    "ckpt_path",
    "weights_only",
    "torch_num_threads",
)


def build_inspect_parser() -> Any:
    """The ``lit-seqpack inspect`` argument parser (jsonargparse, omegaconf mode)."""
    from jsonargparse import ActionConfigFile

    from lit_seqpack.cli import SeqPackArgumentParser
    from lit_seqpack.data.datamodule import SeqPackDataModule

    parser = SeqPackArgumentParser(
        prog="lit-seqpack inspect",
        parser_mode="omegaconf",
        description="Plan one epoch with every packing algorithm, dynamic batching and the padded baseline, "
        "and print microbatches, padding ratio, efficiency, rank imbalance and planning time.",
    )
    parser.add_argument("-c", "--config", action=ActionConfigFile, help="a lit-seqpack fit config (YAML)")
    parser.add_class_arguments(SeqPackDataModule, "data", skip={"dataset"})
    parser.add_argument(
        "--world_size",
        type=int | None,
        default=None,
        help="data-parallel ranks (default: trainer.devices x trainer.num_nodes of the config, else 1)",
    )
    parser.add_argument(
        "--accumulate_grad_batches",
        type=int | None,
        default=None,
        help="microbatches per rank per optimizer step (default: the config's trainer value, else 1)",
    )
    parser.add_argument(
        "--padded_batch_size",
        type=int | None,
        default=None,
        help="samples per microbatch of the padded row (default: data.batch_size in padded mode, else as many "
        "samples as carry max_tokens real tokens on average)",
    )
    parser.add_argument("--epoch", type=int, default=0, help="the epoch to plan (it seeds the shuffle)")
    parser.add_argument(
        "--max_samples",
        type=int,
        default=10_000,
        help="with a stream source: inspect the stream's first this many samples (a stream has no index)",
    )
    parser.add_argument("--plot", type=str | None, default=None, help="write a PNG of lengths and bin fill here")
    parser.add_argument(
        "--batches",
        type=int,
        default=0,
        help="also print the first N training microbatches (one process) decoded with the source's tokenizer, "
        "the tokens that carry loss between [[ and ]]",
    )
    parser.add_argument("--trainer", type=dict | None, default=None, help="a fit config's trainer section")
    for key in _FIT_ONLY_KEYS:
        parser.add_argument(f"--{key}", type=Any, default=None, help="read from a fit config and ignored")
    return parser


def _positive(name: str, value: Any) -> int:
    return check_int(name, value, minimum=1)


def _world_size(trainer: Mapping[str, Any]) -> tuple[int, str | None]:
    """Ranks implied by a trainer section, and a note when it cannot be known without the hardware."""
    devices, nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    elif isinstance(devices, str) and devices.strip().lstrip("-").isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return 1, f"trainer.devices={devices!r} depends on the hardware: planned for 1 rank (pass --world_size)"
    return devices * _positive("trainer.num_nodes", nodes), None


def _is_stream(data: Any) -> bool:
    from lit_seqpack.data.streaming.pipeline import StreamPipeline

    return isinstance(data.pipeline, StreamPipeline)


def _train_split(data: Any, max_samples: int, layout: DataParallelLayout) -> tuple[np.ndarray, np.ndarray, int]:
    """Lengths and loss tokens of the training split, as ``SeqPackDataModule.setup`` prepares them (a stream: the
    samples training reads first on ``layout``)."""
    if _is_stream(data):
        return (*data.pipeline.prefix(max_samples, layout), 0)
    data.prepare_data()
    data.setup("fit")
    splits = data.splits
    _, lengths, loss_tokens = splits["train"]
    held_out = sum(len(split.dataset) for name, split in splits.items() if name != "train")
    return lengths, loss_tokens, held_out


def _header(data: Any, lengths: np.ndarray, held_out: int, world: int, accumulate: int) -> str:
    hp, settings = data.hparams, data.settings
    source = "stream prefix" if _is_stream(data) else repr(data.source)
    lines = [
        f"data: {source} ({lengths.size:,} training samples, {held_out:,} held out), {int(lengths.sum()):,} tokens; "
        f"length min/median/mean/max = {int(lengths.min())}/{np.median(lengths):g}/{lengths.mean():.1f}/"
        f"{int(lengths.max())}",
        f"plan: max_tokens={hp.max_tokens}, window={hp.window}, sequence_length_round={settings.row_multiple}, "
        f"pad_to_multiple_of={settings.document_multiple}, data-parallel ranks={world}, "
        f"accumulate_grad_batches={accumulate}",
    ]
    if data.overlong_report is not None and data.overlong_report.num_overlong:
        lines.append(f"over-long: {data.overlong_report.summary()}")
    return "\n".join(lines)


def _splits_by_rank(data: Any, world: int) -> bool:
    return world > 1 and data.settings.stream_split == "rank"


def _stream_lines(data: Any, max_samples: int, kept: int, rows: Any, layout: DataParallelLayout) -> list[str]:
    """How the streaming loader packs the prefix (windows of ``window`` samples) against the offline plan: one plan
    for all ranks (``stream_split="replicate"``), or each rank's share alone in lock step (``"rank"``)."""
    world, accumulate = layout.world_size, layout.accumulate_grad_batches
    offline = next(row for row in rows if row.configured).stats.num_steps * accumulate
    windows = f"windows of {data.settings.stream_window:,} samples"
    if data.settings.stream_split == "rank" and data.settings.num_workers > 1:
        windows += f" (of each of the {data.settings.num_workers} lanes its loader workers read)"
    if not _splits_by_rank(data, world):
        streamed = data.pipeline.prefix_microbatches(max_samples, layout)
        return [
            f"stream: {type(data.source).__name__}, first {kept:,} samples; {windows} train them in {streamed:,} "
            f"microbatches a rank (the offline plan below: {offline:,}; ratio {offline / streamed:.4f})"
        ]
    lock = data.pipeline.prefix_lock_step(max_samples, layout)
    streamed = lock.microbatches_per_rank
    shares = "; ".join(
        f"rank {rank}: {share.samples:,} samples, {empty:,} of {streamed:,} microbatches empty"
        for rank, (share, empty) in enumerate(zip(lock.shares, lock.empty_per_rank, strict=True))
    )
    return [
        f"stream: {type(data.source).__name__}, first {kept:,} samples of {world} rank shares (stream_split='rank': "
        f"each rank reads its own share from its start, these are the first samples of each); {windows} of each "
        f"share train them in {streamed:,} microbatches a rank in lock step (the offline plan below: {offline:,}; "
        f"ratio {offline / streamed:.4f})",
        f"stream shares: {shares} (the windows' and the lock-step fillers); efficiency {lock.efficiency:.4f} "
        "(as in the table: real tokens / (microbatches x max_tokens))",
    ]


def _decoded_batches(data: Any, count: int) -> str:
    """The first ``count`` training microbatches of one process, decoded (see ``inspection.format_microbatch``)."""
    from lit_seqpack.inspection import format_microbatch

    tokenizer = getattr(data.source, "tokenizer", None)
    decode, how = None, "token ids (the source has no tokenizer)"
    if tokenizer is not None:
        from lit_seqpack._imports import require

        loaded = require("transformers", purpose="decoding batches").AutoTokenizer.from_pretrained(str(tokenizer))
        decode, how = loaded.decode, f"decoded with {tokenizer}"
    lines = [f"the first {count} training microbatches (one process, epoch 0; {how}; loss tokens between [[ and ]]):"]
    for number, batch in enumerate(data.train_dataloader()):
        if number >= count:
            break
        lines.append(format_microbatch(batch, decode=decode, number=number))
    return "\n".join(lines)


def inspect_command(argv: Sequence[str]) -> str:
    """Run ``lit-seqpack inspect`` with ``argv`` (after the word ``inspect``); return the report text.

    Raises:
        ValueError: a bad setting (named), or a dataset without samples.
        ImportError: ``--plot`` without matplotlib.
    """
    from lit_seqpack.cli import ConfigError, user_message
    from lit_seqpack.inspection import compare_plans, format_table, plot_inspection
    from lit_seqpack.parallel import DataParallelLayout

    register_resolvers(list(argv))
    parser = build_inspect_parser()
    cfg = parser.parse_args(list(argv))
    trainer = cfg.trainer or {}
    world, note = _world_size(trainer) if cfg.world_size is None else (_positive("world_size", cfg.world_size), None)
    accumulate = _positive(
        "accumulate_grad_batches",
        trainer.get("accumulate_grad_batches", 1)
        if cfg.accumulate_grad_batches is None
        else cfg.accumulate_grad_batches,
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    try:
        data = instantiate(cfg).data
    except ValueError as err:  # a setting's own error inside jsonargparse's account of a union: alone
        message = user_message(str(err))
        if message == str(err):
            raise
        raise ConfigError(message) from None
    hp = data.hparams
    if hp.max_tokens is None:
        raise ValueError(
            f"data.max_tokens is None (mode={hp.mode!r}): pass --data.max_tokens N, the token budget at which the "
            "packing and dynamic rows are compared with the padded baseline"
        )
    model_parallel = hp.context_parallel_size * hp.tensor_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"world_size={world} must be a multiple of context_parallel_size x tensor_parallel_size={model_parallel}"
        )
    world //= model_parallel  # the plan is made for the data-parallel ranks
    layout = DataParallelLayout(world, 0, accumulate)
    lengths, loss_tokens, held_out = _train_split(data, cfg.max_samples, layout)
    rows = compare_plans(
        lengths,
        data.plan_config(world_size=world, accumulate_grad_batches=accumulate),
        loss_tokens=loss_tokens,
        max_tokens=hp.max_tokens,
        padded_batch_size=cfg.padded_batch_size,
        pad_to_multiple_of=data.settings.document_multiple,
        epoch=cfg.epoch,
    )
    parts = [_header(data, lengths, held_out, world, accumulate)] + ([note] if note else [])
    if _is_stream(data):
        parts += _stream_lines(data, cfg.max_samples, lengths.size, rows, layout)
    parts += ["", format_table(rows), "* the configured mode"]
    if cfg.batches:
        parts += ["", _decoded_batches(data, check_int("batches", cfg.batches, minimum=0))]
    if cfg.plot:
        title = f"{type(data.source).__name__}: max_tokens={hp.max_tokens}, world_size={world}, accumulate={accumulate}"
        parts.append(f"plot: {plot_inspection(rows, lengths, cfg.plot, title=title)}")
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``lit-seqpack``: ``inspect``, ``export`` and ``generate`` here, ``fit`` / ``validate`` /
    ``test`` through ``SeqPackCLI``.

    Args:
        argv: the arguments after the program name (default ``sys.argv[1:]``).
    """
    from lit_seqpack.cli import ConfigError

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        _dispatch(args, argv is None)
    except ConfigError as err:  # a bad setting: its message alone, as argparse reports one
        sys.stderr.write(f"lit-seqpack: error: {err}\n")
        raise SystemExit(2) from None


def _dispatch(args: list[str], from_sys_argv: bool) -> None:
    if args[:1] == ["inspect"]:
        print(inspect_command(args[1:]))
        return
    if args[:1] == ["export"]:
        from lit_seqpack.export import export_command

        print(export_command(args[1:]))
        return
    if args[:1] == ["generate"]:
        from lit_seqpack.generate import generate_command

        print(generate_command(args[1:]))
        return
    from lit_seqpack.cli import SeqPackCLI

    SeqPackCLI(args=None if from_sys_argv else args)


if __name__ == "__main__":
    main()
