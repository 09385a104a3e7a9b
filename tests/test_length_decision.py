"""One length decision: the model's ``max_seq_len`` follows the data's longest row (``eval_max_tokens``, else
``max_tokens``) through the CLI, and a text config whose lengths do not fit fails once, naming every length setting
and values that work (which then train)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lit_seqpack.cli import SeqPackCLI

ROOT = Path(__file__).resolve().parents[1]
TEXT_SFT = ROOT / "configs" / "text_sft.yaml"
QUIET = [
    *("--trainer.logger", "false", "--trainer.callbacks", "[]", "--trainer.enable_checkpointing", "false"),
    *("--trainer.enable_progress_bar", "false", "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0"),
]

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*")


def _cli(*overrides: str, run: bool = False) -> SeqPackCLI:
    subcommand = ["fit"] if run else []
    return SeqPackCLI(args=[*subcommand, "--config", str(TEXT_SFT), *overrides], run=run)


def test_the_models_row_length_follows_the_data(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _cli().model.hparams.max_seq_len == 1024  # text_sft's eval_max_tokens: evaluation rows are the longest
    cli = _cli("--data.max_tokens", "512", "--data.eval_max_tokens", "2048")
    assert cli.model.hparams.max_seq_len == 2048 and cli.model.model.config.max_seq_len == 2048
    assert _cli("--data.max_tokens", "512", "--data.eval_max_tokens", "null").model.hparams.max_seq_len == 512
    assert _cli("--model.init_args.max_seq_len", "3000").model.hparams.max_seq_len == 3000  # set: kept


def test_a_too_small_max_tokens_fails_once_naming_every_length_setting(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as caught:
        _cli("--data.max_tokens", "8", "--data.eval_max_tokens", "8", *QUIET, run=True)
    message = str(caught.value)
    for setting in ("data.max_tokens=8", "data.eval_max_tokens=8", "data.overlong='error'", "max_seq_len=8",
                    "model.init_args.max_seq_len", "overlong='truncate' or overlong='drop'"):  # fmt: skip
        assert setting in message, message
    tokens = int(re.search(r"data\.max_tokens: (\d+) \(a multiple of 8\)", message).group(1))
    evaluation = int(re.search(r"data\.eval_max_tokens: (\d+) or more", message).group(1))
    assert tokens % 8 == 0 and evaluation >= tokens
    # the fix trains (eval rows of 64: "or more"; the packing-isolation probe packs a 47-token row of its own)
    _cli("--data.max_tokens", str(tokens), "--data.eval_max_tokens", str(max(evaluation, 64)), *QUIET, run=True)


def test_a_model_shorter_than_the_rows_is_named_with_the_budgets(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"every sample fits, but data\.max_tokens=256 .*model max_seq_len=128"):
        _cli("--model.init_args.max_seq_len", "128", *QUIET, run=True)
