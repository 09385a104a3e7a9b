"""Command-line and YAML mistakes of issue 17: interpolation on the command line, a misspelt key behind `${...}`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lit_seqpack.cli import SeqPackCLI

REPO = Path(__file__).resolve().parents[2]
SYNTH = {"num_samples": 40, "median_length": 12, "max_length": 40, "vocab_size": 64, "seed": 3}


def _config(tmp_path: Path, data: dict) -> Path:
    model = {"class_path": "lit_seqpack.ReferenceLM", "init_args": {"n_layer": 1, "n_embd": 16, "n_head": 2}}
    model["init_args"]["max_seq_len"] = "${data.max_tokens}"
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": model, "data": data}))
    return path


def test_interpolation_on_the_command_line_is_resolved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: --trainer.default_root_dir '${oc.env:HOME}' made a folder named '${oc.env:HOME}'."""
    monkeypatch.setenv("LIT_SEQPACK_TEST_ROOT", str(tmp_path / "runs"))
    config = _config(tmp_path, {"synthetic": SYNTH, "max_tokens": 64})
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
    config = _config(tmp_path, {"synthetic": SYNTH, "max_tokens": 64})
    args = ["fit", "--config", str(config), "--trainer.logger", "false"]
    cli = SeqPackCLI(args=[*args, "--trainer.default_root_dir", "${oc.env:LIT_SEQPACK_TEST_ROOT}"])
    assert cli.trainer.default_root_dir == str(tmp_path / "runs")
    with pytest.raises(ValueError, match=r"cannot resolve the interpolation in trainer.default_root_dir"):
        SeqPackCLI(args=[*args, "--trainer.default_root_dir", "${oc.env:LIT_SEQPACK_NO_SUCH_VARIABLE}"])


def test_a_misspelt_key_behind_an_interpolation_names_the_typo(tmp_path: Path) -> None:
    """Regression: `max_token:` reported `Interpolation key 'data.max_tokens' not found`."""
    config = _config(tmp_path, {"synthetic": SYNTH, "max_token": 64})
    with pytest.raises(ValueError, match=r"refers to \$\{data.max_tokens\}, but the file sets data.max_token, not"):
        SeqPackCLI(args=["fit", "--config", str(config)])
    shipped = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    shipped["data"]["max_token"] = shipped["data"].pop("max_tokens")
    (tmp_path / "demo.yaml").write_text(json.dumps(shipped))
    with pytest.raises(ValueError, match="is 'max_token' a typo of 'max_tokens'"):
        SeqPackCLI(args=["fit", "--config", str(tmp_path / "demo.yaml")])
