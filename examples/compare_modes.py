"""Compare packing, dynamic batching and the padded baseline on the same data and model, from one CLI config.

Each mode trains the config's model (same seed, same initial weights) on the config's data until the same number
of real (non-padding) tokens has been trained (``--real-tokens``), or for the same number of optimizer steps
(``--max-steps``), at most one epoch, and the PackingMonitor figures are printed side by side::

    python examples/compare_modes.py                                   # configs/demo.yaml, 100k real tokens each
    python examples/compare_modes.py --config configs/packing.yaml --max-steps 50
    python examples/compare_modes.py --real-tokens 20000 -- --data.max_tokens=512   # CLI overrides after --

The padded run uses ``--batch-size`` samples per microbatch (default: as many as carry ``max_tokens`` real tokens
on average). Validation, checkpoints and loggers of the config are switched off; runs are sequential, so on a
busy machine compare them with care (or rerun).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback

from lit_seqpack import PackingMonitor
from lit_seqpack.cli import SeqPackCLI
from lit_seqpack.data.indexed.lengths import compute_lengths_and_loss_tokens
from lit_seqpack.inspection import default_padded_batch_size

ROOT = Path(__file__).resolve().parents[1]
MODES = ("packing", "dynamic", "padded")


class StopAtRealTokens(Callback):
    """Stops training at the end of the optimizer step in which ``target`` real tokens have been trained."""

    def __init__(self, target: int) -> None:
        self.target, self.seen = target, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen += int(batch["num_real_tokens"]) * int(batch["world_size"])  # this rank's share, times ranks
        if self.seen >= self.target:
            trainer.should_stop = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="a lit-seqpack fit config")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--real-tokens", type=int, default=None, help="real tokens per mode (default 100000)")
    budget.add_argument("--max-steps", type=int, default=None, help="optimizer steps per mode instead")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per padded microbatch")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run, in order")
    parser.add_argument("overrides", nargs="*", help="lit-seqpack CLI overrides (after --), e.g. --data.max_tokens=512")
    args = parser.parse_args(argv)
    if args.max_steps is None and args.real_tokens is None:
        args.real_tokens = 100_000
    for name in ("real_tokens", "max_steps", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    return args


def _mode_overrides(mode: str, batch_size: int) -> list[str]:
    if mode == "padded":
        return ["--data.mode=padded", "--data.max_tokens=null", f"--data.batch_size={batch_size}"]
    return [f"--data.mode={mode}"]


def run_mode(args: argparse.Namespace, mode: str, batch_size: int) -> dict[str, Any]:
    """Train one mode and return its figures."""
    overrides = [
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.limit_val_batches=0",
        "--trainer.callbacks=[]",
        f"--trainer.max_steps={args.max_steps or -1}",
        "--trainer.max_epochs=1",  # at most one epoch; a learning-rate schedule spans the same fraction of it
        *args.overrides,
        *_mode_overrides(mode, batch_size),
    ]
    cli = SeqPackCLI(args=["--config", args.config, *overrides], run=False, save_config_callback=None)
    monitor = PackingMonitor(summary=False)
    cli.trainer.callbacks.append(monitor)
    if args.real_tokens is not None:
        cli.trainer.callbacks.append(StopAtRealTokens(args.real_tokens))
    cli.trainer.fit(cli.model, cli.datamodule)
    return {"mode": mode, "steps": cli.trainer.global_step, **monitor.last_summary}


def _padded_batch_size(args: argparse.Namespace) -> int:
    if args.batch_size is not None:
        return args.batch_size
    overrides = ["--trainer.logger=false", *args.overrides]
    cli = SeqPackCLI(args=["--config", args.config, *overrides], run=False, save_config_callback=None)
    lengths, _ = compute_lengths_and_loss_tokens(cli.datamodule.dataset)
    return default_padded_batch_size(lengths, cli.datamodule.hparams.max_tokens or int(lengths.max()))


def format_results(results: list[dict[str, Any]]) -> str:
    """The figures of every mode side by side."""
    header = f"{'mode':<9}{'steps':>7}{'real tokens':>13}{'padding':>9}{'real tok/s':>12}{'computed tok/s':>16}"
    lines = [header]
    for r in results:
        lines.append(
            f"{r['mode']:<9}{r['steps']:>7}{int(r['real_tokens']):>13,}{r['padding_ratio']:>9.2%}"
            f"{r['tokens_per_sec']:>12,.0f}{r['computed_tokens_per_sec']:>16,.0f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    batch_size = _padded_batch_size(args) if "padded" in args.modes else 1
    results = [run_mode(args, mode, batch_size) for mode in args.modes]
    budget = f"{args.real_tokens:,} real tokens" if args.real_tokens else f"{args.max_steps} steps"
    print(f"\n{Path(args.config).name}, {budget} per mode (padded: batch_size={batch_size})")
    print(format_results(results))
    return results


if __name__ == "__main__":
    main()
