"""Every shipped YAML under configs/ parses, instantiates and trains through the CLI from any working directory, writes
under its own name, and has a comment above every key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy

from lit_seqpack.callbacks import PackingMonitor
from lit_seqpack.cli import SeqPackCLI, model_vocab_size
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
CHAT_ASSETS = ROOT / "lit_seqpack" / "data" / "assets" / "chat_demo"
MULTI_PROCESS = {"ddp"}

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*")

# name -> (model class, mode, algorithm or batch size, devices)
EXPECTED = {
    "demo": (ReferenceLM, "packing", "first_fit_decreasing", 1),
    "packing": (ReferenceLM, "packing", "first_fit_decreasing", 1),
    "dynamic": (ReferenceLM, "dynamic", None, 1),
    "padded": (ReferenceLM, "padded", 12, 1),
    "hf_llama": (HFCausalLM, "packing", "first_fit_decreasing", 1),
    "ddp": (ReferenceLM, "packing", "first_fit_decreasing", 2),
    "chat_sft": (ReferenceLM, "packing", "first_fit_decreasing", 1),
    "text_sft": (ReferenceLM, "packing", "first_fit_decreasing", 1),
    "tokenized_sft": (ReferenceLM, "packing", "first_fit_decreasing", 1),
    "vlm_sft": (HFCausalLM, "packing", "first_fit_decreasing", 1),
    "stream": (ReferenceLM, "packing", "best_fit_decreasing", 1),
    "litdata_stream": (ReferenceLM, "packing", "best_fit_decreasing", 1),
}
STREAMS = {"stream", "litdata_stream"}  # no index to plan up front: each has its own training test


def test_every_shipped_config_is_covered():
    assert sorted(path.stem for path in CONFIGS) == sorted(EXPECTED)


def _cli(path: Path, *overrides: str) -> SeqPackCLI:
    return SeqPackCLI(args=["--config", str(path), *overrides], run=False)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_instantiates_the_documented_classes(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # loggers and checkpoints would write relative to the working directory
    model_class, mode, knob, devices = EXPECTED[path.stem]
    cli = _cli(path)
    data, model, trainer = cli.datamodule, cli.model, cli.trainer
    assert type(data) is SeqPackDataModule and type(model) is model_class
    assert data.hparams.mode == mode
    if mode == "packing":
        assert data.hparams.algorithm == knob
    if mode == "padded":
        assert data.hparams.batch_size == knob and data.hparams.max_tokens is None
    assert model_vocab_size(model) == data.vocab_size  # linked (ReferenceLM) or interpolated (HF config)
    assert trainer._accelerator_connector.use_distributed_sampler is False
    assert trainer.num_devices == devices
    assert sum(isinstance(c, PackingMonitor) for c in trainer.callbacks) == 1
    csv, tensorboard = trainer.loggers
    assert isinstance(csv, CSVLogger) and Path(csv.root_dir) == Path("outputs", path.stem)
    assert isinstance(tensorboard, TensorBoardLogger)
    assert Path(tensorboard.root_dir) == Path("outputs", path.stem, "tensorboard")
    (checkpoint,) = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert Path(checkpoint.dirpath) == tmp_path / "outputs" / path.stem / "checkpoints" and checkpoint.save_last
    if mode != "padded":
        assert model.hparams.get("max_seq_len", data.hparams.max_tokens) >= data.hparams.max_tokens
    if path.stem in STREAMS:  # no index: test_config_trains_three_steps_... runs it
        return
    # the DataModule plans without a Trainer: one epoch covers every training sample exactly once
    sampler = data.train_dataloader().batch_sampler
    seen = sorted(i for mb in sampler for i in mb)
    assert seen == list(range(len(data.pipeline.splits["train"][0])))


# small data for a 3-step run: the synthetic and stream sources are big as shipped; the file assets are tiny
_TINY = {
    "lit_seqpack.data.sources.SyntheticInstructionDataset": ["--data.source.init_args.num_samples=200"],
    "lit_seqpack.data.sources.SyntheticStream": ["--data.source.init_args.num_samples=300", "--data.num_workers=0"],
    "lit_seqpack.data.LitDataStream": ["--data.num_workers=0"],
}


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem not in MULTI_PROCESS], ids=lambda p: p.stem)
def test_config_trains_three_steps_from_any_folder_under_its_own_name(path, tmp_path, monkeypatch):
    """Package assets resolve wherever the command runs; logs, TensorBoard events and checkpoints go to
    outputs/<config name>/."""
    if path.stem in ("chat_sft", "text_sft", "hf_llama", "vlm_sft"):
        pytest.importorskip("transformers")
    if path.stem == "litdata_stream":
        pytest.importorskip("litdata")
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    source = yaml.safe_load(path.read_text())["data"]["source"]["class_path"]
    overrides = ["--trainer.max_steps=3", "--trainer.log_every_n_steps=1", *_TINY.get(source, [])]
    cli = SeqPackCLI(args=["fit", "--config", str(path), *overrides])
    assert cli.trainer.global_step == 3
    run = tmp_path / "outputs" / path.stem
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")
    assert state["global_step"] == 3
    assert "train/loss" in (run / "version_0" / "metrics.csv").read_text()
    assert list((run / "tensorboard" / "version_0").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == [path.stem]


def test_chat_sft_config_trains_on_assistant_tokens_and_validates_held_out_conversations(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    cli = SeqPackCLI(
        args=[
            "fit",
            "--config",
            str(ROOT / "configs" / "chat_sft.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.val_check_interval",
            "2",
            "--trainer.logger",
            "false",
        ]
    )
    data, metrics = cli.datamodule, cli.trainer.callback_metrics
    assert cli.trainer.global_step == 3 and torch.isfinite(metrics["val/loss"])
    assert len(data.splits["val"].lengths) == 20 and len(data.splits["train"].lengths) == 380  # 5% held out
    assert data.settings.eval_max_tokens == 1024 > data.hparams.max_tokens
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(CHAT_ASSETS / "tokenizer")
    assert model_vocab_size(cli.model) == data.vocab_size == len(tokenizer)  # the vocabulary is the tokenizer's
    train = data.dataset
    assert 0 < int(train.loss_tokens.sum()) < int(train.lengths.sum()) // 2  # only the assistant turns train


def test_chat_sft_with_an_hf_model_takes_the_tokenizers_vocabulary(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    config = (
        '{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, '
        '"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024}'
    )
    cli = _cli(
        ROOT / "configs" / "chat_sft.yaml",
        "--model",
        "lit_seqpack.model.lm.HFCausalLM",
        "--model.init_args.config",
        config,
        "--trainer.logger",
        "false",
    )
    assert isinstance(cli.model, HFCausalLM)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(CHAT_ASSETS / "tokenizer"))
    assert cli.model.model.config.vocab_size == cli.datamodule.vocab_size == vocab  # not typed anywhere


def test_demo_config_checkpoints_mid_epoch_and_keeps_last(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = _cli(ROOT / "configs" / "demo.yaml").trainer
    (checkpoint,) = [c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert checkpoint.save_last and checkpoint._every_n_train_steps > 0
    assert Path(checkpoint.dirpath) == tmp_path / "outputs" / "demo" / "checkpoints"
    assert trainer.max_steps > 0 and trainer.max_epochs == 1


def test_the_committed_litdata_folder_is_what_its_documented_command_writes():
    """The config's comment gives the command that wrote the asset: the folder must hold exactly its samples."""
    pytest.importorskip("litdata")
    from lit_seqpack.data import LitDataStream, SyntheticStream

    assert "SyntheticStream(num_samples=600," in (ROOT / "configs" / "litdata_stream.yaml").read_text()
    written = SyntheticStream(num_samples=600, vocab_size=64, median_length=48, sigma=0.8, max_length=400).open()
    stored = LitDataStream(str(ROOT / "lit_seqpack" / "data" / "assets" / "litdata_demo")).open()
    for want, got in zip(written, stored, strict=True):
        assert got["input_ids"].tolist() == want["input_ids"] and got["labels"].tolist() == want["labels"]


def test_ddp_config_is_two_cpu_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = _cli(ROOT / "configs" / "ddp.yaml").trainer
    assert isinstance(trainer.strategy, DDPStrategy)
    assert trainer.strategy.root_device.type == "cpu" and trainer.num_devices == 2
    assert trainer.accumulate_grad_batches == 2


_KEY = re.compile(r"^\s*(- )?[A-Za-z_][\w.]*:")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_a_comment_above_every_key(path):
    lines = path.read_text().splitlines()
    previous = ""
    for number, line in enumerate(lines, 1):
        if _KEY.match(line):
            assert previous.lstrip().startswith("#"), f"{path.name}:{number} {line.strip()!r} has no comment above"
        if line.strip():
            previous = line


def _write(tmp_path: Path, change: dict) -> Path:
    config = yaml.safe_load((ROOT / "configs" / "packing.yaml").read_text())
    config["data"].update(change)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_unknown_mode_in_yaml_fails_naming_the_knob(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        _cli(_write(tmp_path, {"mode": "both"}))
    error = capsys.readouterr().err
    assert "data.mode" in error and "both" in error and "packing" in error


def test_unknown_algorithm_in_yaml_fails_naming_the_knob(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"algorithm.*'tetris'"):
        _cli(_write(tmp_path, {"algorithm": "tetris"}))


def test_knob_of_the_wrong_mode_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"batch_size=8 only applies to mode='padded'"):
        _cli(_write(tmp_path, {"batch_size": 8}))
