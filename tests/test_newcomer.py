"""The newcomer's path through the CLI: errors as their message alone, misspelt keys with a suggestion, what
``--ckpt_path last`` picks, learning-rate and gradient-norm logging in the shipped configs, decoded batches from
``inspect --batches``, and an install line that works from the clone."""

from __future__ import annotations

import csv
import logging
import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import tomllib
import torch
import yaml
from lightning.pytorch.callbacks import Callback, LearningRateMonitor

from lit_seqpack.__main__ import inspect_command, main
from lit_seqpack.callbacks import GradNormMonitor
from lit_seqpack.cli import SeqPackCLI
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.data.sources.synthetic import SyntheticInstructionDataset
from lit_seqpack.model.lm import ReferenceLM
from tests.test_cli import tiny_demo

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*"),
]


def _error_of(capsys: pytest.CaptureFixture, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("--data.max_token", "--data.max_tokens"),  # a prefix: argparse used to read it as --data.max_tokens
        ("--data.max_tokenz", "--data.max_tokens"),
        ("--trainer.max_step", "--trainer.max_steps"),
    ],
)
def test_a_misspelt_key_is_refused_with_the_closest_keys(tmp_path, monkeypatch, capsys, typo, meant):
    monkeypatch.chdir(tmp_path)
    err = _error_of(capsys, ["fit", "--config", str(ROOT / "configs" / "demo.yaml"), typo, "64"])
    assert f"unrecognized arguments: {typo} 64 (did you mean {meant}" in err.lower()  # "Unrecognized" before 4.5x
    assert "usage:" not in err and len(err.splitlines()) <= 3  # the message alone, not the options of every class


def test_a_misspelt_key_in_a_config_file_is_refused_with_the_closest_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["data"]["val_fractio"] = config["data"].pop("val_fraction")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    err = _error_of(capsys, ["fit", "--config", str(path)])
    # jsonargparse's own words changed at 4.5x ("nested key" before "option"); the closest key is named in both
    assert re.search(r"does not accept (option|nested key) 'data.val_fractio' \(did you mean data.val_fraction", err)
    assert len(err.splitlines()) <= 3


def test_a_misspelt_model_argument_is_refused_with_the_models_own_parameter(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    demo = str(ROOT / "configs" / "demo.yaml")
    err = _error_of(capsys, ["fit", "--config", demo, "--model.init_args.n_layers", "3"])
    unaccepted = r"(Option 'n_layers' is not accepted|Key 'n_layers' is not expected) \(did you mean n_layer\?\)"
    assert re.search(unaccepted, err) and len(err.splitlines()) <= 3


def test_errors_lit_seqpack_raises_while_instantiating_reach_the_user_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text_sft = str(ROOT / "configs" / "text_sft.yaml")
    err = _error_of(capsys, ["fit", "--config", text_sft, "--data.source.init_args.tokenizer", str(tmp_path / "no")])
    assert err.startswith("lit-seqpack: error: TextSource(tokenizer=") and "is not a local folder" in err
    assert "Union subtypes" not in err and "Traceback" not in err and len(err.splitlines()) == 1
    hf = str(ROOT / "configs" / "hf_llama.yaml")
    err = _error_of(capsys, ["fit", "--config", hf, "--model.init_args.config.vocab_size", "8"])
    assert "is more than the model's config.vocab_size=8" in err and "Union subtypes" not in err
    assert len(err.splitlines()) == 1
    tokenized = str(ROOT / "configs" / "tokenized_sft.yaml")
    err = _error_of(capsys, ["fit", "--config", tokenized, "--data.source.init_args.path", "${asset:nope/x.jsonl}"])
    assert err.startswith("lit-seqpack: error: cannot resolve the interpolation in data.source.init_args.path")
    assert "no such asset" in err and "Traceback" not in err
    missing = str(tmp_path / "no")
    err = _error_of(capsys, ["inspect", "--config", text_sft, "--data.source.init_args.tokenizer", missing])
    assert err.startswith("lit-seqpack: error: ") and "Union subtypes" not in err


def test_ckpt_path_last_resumes_the_newest_run_of_the_config_as_the_docs_say(tmp_path, monkeypatch, caplog):
    """Two fresh runs of one config: the second writes last-v1.ckpt, and ``last`` resumes it (docs/getting-started)."""
    monkeypatch.chdir(tmp_path)
    config = tiny_demo(tmp_path, max_steps=4)  # checkpoints every 4 steps, mid-epoch
    main(["fit", "--config", str(config)])
    main(["fit", "--config", str(config), "--trainer.max_steps", "8"])
    folder = tmp_path / "outputs" / "demo_tiny" / "checkpoints"
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 4
    assert torch.load(folder / "last-v1.ckpt", weights_only=False)["global_step"] == 8
    with caplog.at_level(logging.INFO):
        resumed = SeqPackCLI(args=["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "12"])
    assert Path(resumed.trainer.ckpt_path) == folder / "last-v1.ckpt"
    assert f"--ckpt_path last resumes {folder / 'last-v1.ckpt'}, the newest" in caplog.text
    assert "also there: last.ckpt" in caplog.text
    assert resumed.trainer.global_step == 12
    assert torch.load(folder / "last-v1.ckpt", weights_only=False)["global_step"] == 12  # that run goes on
    assert torch.load(folder / "last.ckpt", weights_only=False)["global_step"] == 4  # the other run is untouched
    versions = sorted(p.name for p in (tmp_path / "outputs" / "demo_tiny").glob("version_*"))
    assert versions == ["version_0", "version_1", "version_2"]  # every run's logs in a folder of its own
    text = (ROOT / "docs" / "getting-started.md").read_text()
    assert "`--ckpt_path last` resumes the newest `last*.ckpt`" in text and "`last-v1.ckpt`" in text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_logs_the_learning_rate_and_the_gradient_norm(path):
    callbacks = yaml.safe_load(path.read_text())["trainer"]["callbacks"]
    names = {callback["class_path"] for callback in callbacks}
    assert {"lightning.pytorch.callbacks.LearningRateMonitor", "lit_seqpack.callbacks.GradNormMonitor"} <= names


def test_the_demo_config_writes_the_learning_rate_and_gradient_norm_columns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = SeqPackCLI(args=["fit", "--config", str(tiny_demo(tmp_path, max_steps=4, log_every_n_steps=1))])
    assert any(isinstance(c, LearningRateMonitor) for c in cli.trainer.callbacks)
    with (tmp_path / "outputs" / "demo_tiny" / "version_0" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    column = next(key for key in rows[0] if key.startswith("lr-AdamW"))  # one per parameter group
    lrs = [float(row[column]) for row in rows if row.get(column)]
    norms = [float(row["train/grad_norm"]) for row in rows if row.get("train/grad_norm")]
    assert len(lrs) == 4 and lrs[0] < lrs[-1]  # the warmup
    assert len(norms) == 4 and all(norm > 0 for norm in norms)


class _NormRecorder(Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []
        self.logged: list[float] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        grads = [p.grad.flatten() for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.cat(grads).norm()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.logged.append(float(trainer.callback_metrics["train/grad_norm"]))


def test_grad_norm_monitor_logs_the_norm_before_clipping():
    source = SyntheticInstructionDataset(num_samples=200, median_length=24, max_length=64, vocab_size=32)
    data = SeqPackDataModule(source=source, max_tokens=128)
    model = ReferenceLM(vocab_size=data.vocab_size, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    recorder = _NormRecorder()
    trainer = L.Trainer(
        max_steps=3,
        log_every_n_steps=1,
        gradient_clip_val=1e-3,  # clips every step: the logged norm is the one before
        callbacks=[GradNormMonitor(), recorder],
        use_distributed_sampler=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, data)
    assert recorder.logged == pytest.approx(recorder.norms, rel=1e-5)
    assert min(recorder.norms) > 1e-3


@pytest.mark.parametrize(("config", "marked"), [("text_sft", r"\[\[.+\]\]"), ("chat_sft", r"<\|assistant\|>\s*\[\[")])
def test_inspect_batches_prints_decoded_microbatches_with_the_loss_tokens_marked(config, marked):
    text = inspect_command(["--config", str(ROOT / "configs" / f"{config}.yaml"), "--batches", "2"])
    assert "the first 2 training microbatches" in text and "decoded with" in text
    assert "microbatch 0: packed row of" in text and "microbatch 1:" in text and "microbatch 2:" not in text
    documents = [line for line in text.splitlines() if line.startswith("  document ")]
    assert documents and all(re.search(marked, line) for line in documents if "0 loss)" not in line)
    if config == "chat_sft":  # assistant turns only: the user's words are never between the marks
        assert all("<|user|>" not in part for line in documents for part in re.findall(r"\[\[(.*?)\]\]", line))


def test_the_readme_installs_from_the_clone_and_says_how_to_reach_the_command():
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install") : readme.index("## Quick start")]
    assert "pip install lit-seqpack " not in install and "pip install 'lit-seqpack" not in install
    assert "source .venv/bin/activate" in install and ".venv/bin/lit-seqpack" in install
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = set(re.findall(r"pip install -e '\.\[([\w-]+)\]'", install))
    assert named and named <= extras  # every extra of the install lines exists
    assert (ROOT / "scripts" / "setup_env.sh").is_file() and "pip install -e ." in install
