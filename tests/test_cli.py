"""The ``lit-seqpack`` CLI: the demo config trains and resumes mid-epoch exactly, the vocabulary link, subcommands."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback, LightningDataModule

from lit_seqpack.__main__ import main
from lit_seqpack.cli import SeqPackCLI, check_vocab, model_vocab_size
from lit_seqpack.data.datamodule import SeqPackDataModule
from lit_seqpack.model.lm import HFCausalLM, ReferenceLM
from tests._limits import SUBPROCESS_TIMEOUT_S, TEST_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*Checkpoint directory .* exists and is not empty.*"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`.*"),
    pytest.mark.filterwarnings("ignore:.*isinstance.treespec, LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*smaller than the logging interval.*"),
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*"),
]

TINY_DATA = {"num_samples": 240, "median_length": 32, "max_length": 128}


def tiny_demo(tmp_path: Path, **trainer: Any) -> Path:
    """The shipped demo config with a small dataset and budget, written to ``tmp_path``."""
    config = yaml.safe_load(DEMO.read_text())
    config["data"]["max_tokens"] = 256
    config["data"]["source"]["init_args"].update(TINY_DATA)
    config["data"]["val_fraction"] = 0.05
    config["trainer"].update(trainer)
    for callback in config["trainer"]["callbacks"]:
        if callback["class_path"].endswith("ModelCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = 4
    path = tmp_path / "demo_tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _Indexed:
    """A dataset view whose samples carry their index (the collator ignores extra keys)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**self.dataset[index], "sample_index": int(index)}


class _CollateWithIndices:
    def __init__(self, collate: Any) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> dict[str, Any]:
        batch = self.collate(samples)
        batch["sample_indices"] = [sample["sample_index"] for sample in samples]
        return batch


class RecordingDataModule(SeqPackDataModule):
    """The DataModule with the training-split indices of every sample added to each training batch."""

    def train_dataloader(self):
        loader = super().train_dataloader()
        loader.dataset.dataset = _Indexed(loader.dataset.dataset)
        loader.collate_fn = _CollateWithIndices(loader.collate_fn)
        return loader


class TrainedIndices(Callback):
    """Records the sample indices of every microbatch that reaches ``training_step`` (not the prefetched ones)."""

    def __init__(self) -> None:
        self.microbatches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.microbatches.append(list(batch["sample_indices"]))


def _fit(config: Path, *overrides: str) -> tuple[SeqPackCLI, TrainedIndices]:
    recorder = TrainedIndices()
    cli = SeqPackCLI(
        datamodule_class=RecordingDataModule,
        trainer_defaults={"callbacks": [recorder]},
        args=["fit", "--config", str(config), *overrides],
    )
    return cli, recorder


def test_demo_config_trains_logs_checkpoints_and_resumes_mid_epoch_exactly(tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    config = tiny_demo(tmp_path, max_steps=8, log_every_n_steps=2)
    caplog.set_level(logging.INFO)
    first, before = _fit(config)
    train_size = len(first.datamodule.pipeline.splits["train"][0])
    sampler = first.datamodule.train_dataloader().batch_sampler
    sampler.set_epoch(0)
    epoch = sampler.plan.rank_microbatches(0)
    assert len(before.microbatches) == 8 < len(epoch)  # stopped mid-epoch
    assert before.microbatches == epoch[:8]
    bar = capsys.readouterr().out  # Lightning's TQDM bar writes to stdout
    assert "train/tokens_per_sec=" in bar and "train/padding_ratio=" in bar
    assert "PackingMonitor summary" in caplog.text and "train/loss" in caplog.text
    last = tmp_path / "outputs" / "demo_tiny" / "checkpoints" / "last.ckpt"  # the config file's name
    assert last.is_file() and (tmp_path / "outputs" / "demo_tiny" / "version_0" / "metrics.csv").is_file()

    # resume from the file: the rest of the epoch, each remaining sample exactly once, in the planned order
    resumed, after = _fit(config, "--ckpt_path", str(last), "--trainer.max_steps", "-1")
    assert resumed.trainer.global_step == len(epoch)
    assert after.microbatches == epoch[8:]
    seen = [i for mb in before.microbatches + after.microbatches for i in mb]
    assert sorted(seen) == list(range(train_size))


def test_resume_by_name_last_finds_this_configs_own_checkpoint(tmp_path, monkeypatch):
    """Two copies of one config in one folder keep apart: ``--ckpt_path last`` resumes each from its own run."""
    monkeypatch.chdir(tmp_path)
    config = tiny_demo(tmp_path, max_steps=4)
    other = tmp_path / "other_run.yaml"
    other.write_text(config.read_text())
    main(["fit", "--config", str(config)])
    main(["fit", "--config", str(other), "--trainer.max_steps", "2"])
    resumed = SeqPackCLI(args=["fit", "--config", str(config), "--ckpt_path", "last", "--trainer.max_steps", "6"])
    last = tmp_path / "outputs" / "demo_tiny" / "checkpoints" / "last.ckpt"
    assert Path(resumed.trainer.ckpt_path) == last
    assert torch.load(last, weights_only=False, map_location="cpu")["global_step"] == 6
    other_last = tmp_path / "outputs" / "other_run" / "checkpoints" / "last.ckpt"
    assert torch.load(other_last, weights_only=False, map_location="cpu")["global_step"] == 2


def test_validate_subcommand_logs_the_loss(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = SeqPackCLI(args=["validate", "--config", str(tiny_demo(tmp_path))])
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["val/loss"]) and "val/padding_ratio" in metrics


def _tiny_cli(*args: str, model: str = "lit_seqpack.model.lm.ReferenceLM") -> SeqPackCLI:
    return SeqPackCLI(
        args=[
            "--model",
            model,
            "--data.source",
            "SyntheticInstructionDataset",
            "--data.source.init_args.num_samples",
            "64",
            "--data.source.init_args.vocab_size",
            "40",
            "--trainer.logger",
            "false",
            *args,
        ],
        run=False,
    )


def test_vocab_is_linked_from_the_data_and_cannot_be_set_twice():
    cli = _tiny_cli("--model.init_args.n_layer", "1")
    assert cli.model.hparams.vocab_size == cli.datamodule.vocab_size == model_vocab_size(cli.model) == 40
    assert cli.trainer._accelerator_connector.use_distributed_sampler is False
    with pytest.raises(ValueError, match=r"model.init_args.vocab_size=12 is set twice.*data.vocab_size=40"):
        _tiny_cli("--model.init_args.vocab_size", "12")


HF_CONFIG = (
    '{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, '
    '"num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB}'
)


def test_hf_model_vocab_is_linked_and_checked():
    hf = "lit_seqpack.model.lm.HFCausalLM"
    with pytest.raises(
        ValueError, match=r"vocab_size=40 \(the data's ids\) is more than the model's config.vocab_size=32"
    ):
        _tiny_cli("--model.init_args.config", HF_CONFIG.replace("VOCAB", "32"), model=hf)
    cli = _tiny_cli("--model.init_args.config", HF_CONFIG.replace("VOCAB", "48"), model=hf)
    assert isinstance(cli.model, HFCausalLM) and model_vocab_size(cli.model) == 48  # padded embeddings are kept
    # a config without vocab_size takes the data's (the tokenizer's, for text and chat data)
    unsized = HF_CONFIG.replace(', "vocab_size": VOCAB', "")
    cli = _tiny_cli("--model.init_args.config", unsized, model=hf)
    assert model_vocab_size(cli.model) == cli.model.hparams.vocab_size == cli.datamodule.vocab_size == 40
    # the linked value is a real argument: a checkpoint passes it back to __init__ and rebuilds the same model
    arguments = {key: value for key, value in cli.model.hparams.items() if not key.startswith("_")}
    assert HFCausalLM(**arguments).model.config.vocab_size == 40


def test_hf_checkpoint_written_by_the_cli_resumes_and_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load((ROOT / "configs" / "hf_llama.yaml").read_text())
    config["model"]["init_args"]["config"].update(hidden_size=16, intermediate_size=32, num_hidden_layers=1)
    config["data"].update(max_tokens=256)
    config["data"]["source"]["init_args"].update(TINY_DATA)
    config["trainer"].update(max_steps=2, logger=False)
    (checkpoint,) = [c for c in config["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    checkpoint["init_args"]["every_n_train_steps"] = 2
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(config))
    SeqPackCLI(args=["fit", "--config", str(path)])
    ckpt = tmp_path / "outputs" / "hf" / "checkpoints" / "last.ckpt"  # where `lit-seqpack export` reads it
    resumed = SeqPackCLI(args=["fit", "--config", str(path), "--ckpt_path", str(ckpt), "--trainer.max_steps", "3"])
    assert resumed.trainer.global_step == 3
    loaded = HFCausalLM.load_from_checkpoint(ckpt)
    assert model_vocab_size(loaded) == 64


def test_check_vocab_without_a_known_vocabulary_passes():
    class Opaque(torch.nn.Module):
        hparams: dict = {}

    check_vocab(Opaque(), 10**6)  # nothing to compare: no error
    assert model_vocab_size(ReferenceLM(vocab_size=32, n_layer=1, n_embd=16, n_head=2, n_kv_head=1)) == 32


def test_help_lists_the_subcommands_and_inspect(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "lit-seqpack" in text and "inspect" in text
    assert all(name in text for name in ("fit", "validate", "test", "predict"))


def _run(args: list[str], cwd: Path, path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ROOT, *path))), "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lit_seqpack", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_demo_command_as_a_new_user_runs_it(tmp_path):
    result = _run(
        [
            "fit",
            "--config",
            str(DEMO),
            "--trainer.max_steps",
            "6",
            "--trainer.log_every_n_steps",
            "2",
            "--data.max_tokens",
            "256",
            *[f"--data.source.init_args.{key}={value}" for key, value in TINY_DATA.items()],
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "train/tokens_per_sec=" in output and "train/padding_ratio=" in output
    assert "PackingMonitor summary" in output
    assert (tmp_path / "outputs" / "demo" / "checkpoints" / "last.ckpt").is_file()


_OWN_DATASET = """
import torch
from torch.utils.data import Dataset


class CountingDataset(Dataset):
    \"\"\"A user's own dataset: ids 1..vocab-1 in documents of 3..17 tokens.\"\"\"

    def __init__(self, num_samples: int = 50, vocab: int = 40) -> None:
        self.items = [torch.arange(3 + i % 15) % (vocab - 1) + 1 for i in range(num_samples)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.items[index]}
"""


@pytest.mark.slow
def test_a_users_own_dataset_class_trains_from_a_yaml_class_path(tmp_path):
    """``data.source.class_path`` names a torch Dataset subclass of a module on PYTHONPATH: no registration."""
    package = tmp_path / "user_code"
    package.mkdir()
    (package / "my_data.py").write_text(_OWN_DATASET)
    config = yaml.safe_load(DEMO.read_text())
    config["data"]["source"] = {"class_path": "my_data.CountingDataset", "init_args": {"num_samples": 120}}
    config["data"] |= {"max_tokens": 64, "val_fraction": 0.1}
    config["trainer"] |= {"max_steps": 4, "val_check_interval": 2, "log_every_n_steps": 1}
    config["model"]["init_args"]["max_seq_len"] = 64
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["fit", "--config", str(path)], cwd=tmp_path, path=(package,))
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = next((tmp_path / "outputs" / "own").glob("version_*/metrics.csv")).read_text()
    assert "val/loss" in metrics and "train/loss" in metrics
    saved = yaml.safe_load(next((tmp_path / "outputs" / "own").glob("version_*/config.yaml")).read_text())
    assert saved["data"]["source"]["class_path"] == "my_data.CountingDataset"
    hparams = yaml.safe_load(next((tmp_path / "outputs" / "own").glob("version_*/hparams.yaml")).read_text())
    assert hparams["vocab_size"] == 18  # linked to the data's vocabulary: its largest id (17) + 1


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_ddp_config_runs_two_cpu_processes_without_hanging(tmp_path):
    result = _run(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "ddp.yaml"),
            "--trainer.max_steps",
            "3",
            "--trainer.log_every_n_steps",
            "1",
            "--data.source.init_args.num_samples",
            "400",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in output
    assert "PackingMonitor summary" in output and "`Trainer.fit` stopped: `max_steps=3` reached" in output
    metrics = (tmp_path / "outputs" / "ddp" / "version_0" / "metrics.csv").read_text()
    assert "train/rank_imbalance" in metrics


def test_test_subcommand_runs_the_test_split_or_explains_why_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["test", "--config", str(tiny_demo(tmp_path))]
    cli = SeqPackCLI(args=[*args, "--data.test_fraction", "0.1"])
    assert torch.isfinite(cli.trainer.callback_metrics["test/loss"])
    with pytest.raises(ValueError, match="test_fraction > 0"):
        SeqPackCLI(args=args)


def test_test_from_a_checkpoint_refuses_a_split_the_checkpoint_trained_on(tmp_path, monkeypatch):
    """Regression: `test --data.test_fraction 0.05 --ckpt_path last` after a run without a test split evaluated
    samples the checkpoint trained on."""
    monkeypatch.chdir(tmp_path)
    config = str(tiny_demo(tmp_path, max_steps=2))
    SeqPackCLI(args=["fit", "--config", config])
    with pytest.raises(
        ValueError, match=r"of the 12 test samples .* are samples this checkpoint trained on: it held out"
    ):
        SeqPackCLI(args=["test", "--config", config, "--data.test_fraction", "0.05", "--ckpt_path", "last"])
    SeqPackCLI(args=["fit", "--config", config, "--data.test_fraction", "0.05", "--trainer.max_steps", "2"])
    held_out = SeqPackCLI(args=["test", "--config", config, "--data.test_fraction", "0.05", "--ckpt_path", "last"])
    assert torch.isfinite(held_out.trainer.callback_metrics["test/loss"])  # the samples it held out
    with pytest.raises(ValueError, match=r"data.seed=1\) are samples this checkpoint trained on"):
        SeqPackCLI(args=["validate", "--config", config, "--data.test_fraction", "0.05", "--data.seed", "1",
                         "--ckpt_path", "last"])  # fmt: skip


class WithoutTestLoader(SeqPackDataModule):
    """A user DataModule that defines no test split."""

    test_dataloader = LightningDataModule.test_dataloader


def test_test_subcommand_explains_a_datamodule_without_test_loader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="defines no test_dataloader"):
        SeqPackCLI(datamodule_class=WithoutTestLoader, args=["test", "--config", str(tiny_demo(tmp_path))])


def test_registering_the_resolvers_warns_nothing() -> None:
    """omegaconf 2.4 deprecates register_new_resolver (register_resolver replaces it; 2.3 has only the former)."""
    import warnings

    from lit_seqpack.cli import register_resolvers

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        register_resolvers(["fit", "--config", "configs/demo.yaml"])
    assert [str(w.message) for w in caught] == []
