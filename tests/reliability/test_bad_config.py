"""Command-line and YAML mistakes of issue 17: interpolation on the command line, a misspelt key behind `${...}`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_seqpack.cli import SeqPackCLI

REPO = Path(__file__).resolve().parents[2]
SYNTH = {"num_samples": 40, "median_length": 12, "max_length": 40, "vocab_size": 64, "seed": 3}
SYNTH_SOURCE = {"class_path": "lit_seqpack.data.sources.SyntheticInstructionDataset", "init_args": SYNTH}


def _config(tmp_path: Path, data: dict) -> Path:
    model = {"class_path": "lit_seqpack.ReferenceLM", "init_args": {"n_layer": 1, "n_embd": 16, "n_head": 2}}
    model["init_args"]["max_seq_len"] = "${data.max_tokens}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": model, "data": data}))
    return path


def test_interpolation_on_the_command_line_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: --trainer.default_root_dir '${oc.env:HOME}' made a folder named '${oc.env:HOME}'."""
    monkeypatch.setenv("LIT_SEQPACK_TEST_ROOT", str(tmp_path / "runs"))
    config = _config(tmp_path, {"source": SYNTH_SOURCE, "max_tokens": 64})
    args = ["--config", str(config), "--trainer.logger", "false"]
    args += [
        "--trainer.default_root_dir",
        "${oc.env:LIT_SEQPACK_TEST_ROOT}",
        "--data.cache_dir",
        "${trainer.default_root_dir}/c",
    ]
    cli = SeqPackCLI(args=args, run=False)
    assert cli.trainer.default_root_dir == str(tmp_path / "runs")
    assert cli.datamodule.hparams.cache_dir == str(tmp_path / "runs" / "c")
    assert cli.model.hparams.max_seq_len == 64  # the YAML's own interpolation still works


def test_interpolation_on_the_command_line_of_a_subcommand_is_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIT_SEQPACK_TEST_ROOT", str(tmp_path / "runs"))
    monkeypatch.setattr(SeqPackCLI, "_run_subcommand", lambda self, name: None)
    config = _config(tmp_path, {"source": SYNTH_SOURCE, "max_tokens": 64})
    args = ["fit", "--config", str(config), "--trainer.logger", "false"]
    cli = SeqPackCLI(args=[*args, "--trainer.default_root_dir", "${oc.env:LIT_SEQPACK_TEST_ROOT}"])
    assert cli.trainer.default_root_dir == str(tmp_path / "runs")
    with pytest.raises(ValueError, match=r"cannot resolve the interpolation in trainer.default_root_dir"):
        SeqPackCLI(args=[*args, "--trainer.default_root_dir", "${oc.env:LIT_SEQPACK_NO_SUCH_VARIABLE}"])


def test_a_misspelt_key_behind_an_interpolation_names_the_typo(tmp_path: Path) -> None:
    """Regression: `max_token:` reported `Interpolation key 'data.max_tokens' not found`."""
    config = _config(tmp_path, {"source": SYNTH_SOURCE, "max_token": 64})
    with pytest.raises(ValueError, match=r"refers to \$\{data.max_tokens\}, but the file sets data.max_token, not"):
        SeqPackCLI(args=["fit", "--config", str(config)])
    shipped = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    shipped["data"]["max_token"] = shipped["data"].pop("max_tokens")
    shipped["model"]["init_args"]["max_seq_len"] = "${data.max_tokens}"  # the CLI sets it; a user may still refer
    (tmp_path / "demo.yaml").write_text(json.dumps(shipped))
    with pytest.raises(ValueError, match="is 'max_token' a typo of 'max_tokens'"):
        SeqPackCLI(args=["fit", "--config", str(tmp_path / "demo.yaml")])


def test_padded_mode_has_no_token_cap_unless_one_is_given() -> None:
    """Regression: padded mode capped samples at the default max_tokens=2048 although the README said null."""
    from lit_seqpack import SeqPackDataModule

    records = [{"input_ids": list(range(1, 3001))}, {"input_ids": [1, 2]}]
    dm = SeqPackDataModule(source=records, mode="padded", batch_size=2)
    assert dm.hparams.max_tokens is None and [b["input_ids"].shape[1] for b in dm.train_dataloader()] == [3000]
    assert SeqPackDataModule().hparams.max_tokens == SeqPackDataModule(mode="dynamic").hparams.max_tokens == 2048
    with pytest.raises(ValueError, match=r"1 of 2 samples are longer than max_tokens=2048"):
        SeqPackDataModule(source=records, mode="padded", batch_size=2, max_tokens=2048).setup("fit")


def test_a_validation_split_without_loss_tokens_is_skipped_with_a_warning(tmp_path: Path) -> None:
    """Regression: it logged val/loss = nan."""
    import lightning as L

    from lit_seqpack import ReferenceLM, SeqPackDataModule
    from lit_seqpack.data.indexed.splits import split_indices

    records = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]} for _ in range(10)]
    (held_out,) = split_indices(10, 0.1, seed=0)[1].tolist()
    records[held_out] = {"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}
    dm = SeqPackDataModule(source=records, max_tokens=16, val_fraction=0.1, seed=0)
    dm.setup("fit")
    assert int(dm.splits["val"].loss_tokens.sum()) == 0  # the held-out sample is the masked one
    model = ReferenceLM(vocab_size=8, n_layer=1, n_head=2, n_kv_head=1, n_embd=16, intermediate_size=32)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=2,
                        enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(
        UserWarning, match=r"the validation split \(1 samples\) has no loss token.*validation is skipped"
    ):
        trainer.fit(model, datamodule=dm)
    assert "val/loss" not in trainer.callback_metrics


def test_an_interpolation_of_a_key_that_no_file_sets_says_which(tmp_path: Path) -> None:
    config = _config(tmp_path, {"source": SYNTH_SOURCE, "max_tokens": 64})
    text = config.read_text().replace("${data.max_tokens}", "${data.budget}")
    config.write_text(text)
    with pytest.raises(ValueError, match=r"interpolation in model.init_args.max_seq_len failed: .*set data.budget"):
        SeqPackCLI(args=["fit", "--config", str(config)])


@pytest.mark.parametrize("value", ["lots", 2.5, -5])
def test_a_bad_data_max_tokens_behind_an_interpolation_names_data_max_tokens(tmp_path: Path, value: object) -> None:
    """Regression: `max_tokens: lots` was reported as the model's max_seq_len (the `${data.max_tokens}` target)."""
    config = _config(tmp_path, {"source": SYNTH_SOURCE, "max_tokens": value})
    match = rf"config.yaml: data.max_tokens={value!r} is not valid .*refers to it as \$\{{data.max_tokens\}}"
    with pytest.raises(ValueError, match=match):
        SeqPackCLI(args=["fit", "--config", str(config)])
