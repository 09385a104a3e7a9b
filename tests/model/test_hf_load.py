"""Tests for lit_seqpack.model.hf_load through HFCausalLM: checkpoints as users load them, LoRA, HF export."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lit_seqpack.__main__ import main  # noqa: E402
from lit_seqpack.model.hf_load import weight_dtype_warning  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402
from lit_seqpack.model.lm import HFCausalLM  # noqa: E402
from tests.model._hf_tiny import TINY_HF  # noqa: E402

LLAMA = {"model_type": "llama", **TINY_HF}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def _docs(lengths: tuple[int, ...] = (7, 12, 5), seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=gen) for n in lengths]


def _checkpoint(tmp_path: Path, dtype: torch.dtype = torch.float32, tokenizer: bool = False) -> str:
    torch.manual_seed(0)
    config = AutoConfig.for_model(**LLAMA)
    AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(tmp_path / "base")
    if tokenizer:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(63)} | {"[UNK]": 63}
        fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
        fast.save_pretrained(tmp_path / "base")
    return str(tmp_path / "base")


def _fit(module: HFCausalLM, steps: int = 2, **kwargs: Any) -> Trainer:
    batch = documents_batch(_docs())
    trainer = Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, **kwargs,
    )  # fmt: skip
    trainer.fit(module, torch.utils.data.DataLoader([batch] * steps, batch_size=None))
    return trainer


def _assert_per_document_logits(module: HFCausalLM, reference: Any, docs: list[torch.Tensor]) -> None:
    """The module's packed logits equal ``reference`` run on each document alone."""
    with torch.no_grad():
        packed = module.eval().seqpack_forward(documents_batch(docs))[0]
        start = 0
        for doc in docs:
            alone = reference.eval()(input_ids=doc[None]).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, atol=1e-5, rtol=0)
            start += len(doc)


def test_a_pretrained_checkpoint_trains_in_train_mode_with_options_and_overrides(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path)
    module = HFCausalLM(
        model_name_or_path=path, model_kwargs={"attn_implementation": "eager"}, config_overrides={"rms_norm_eps": 1e-3}
    )
    assert all(m.training for m in module.model.modules())  # from_pretrained alone gives eval mode
    assert module.model.config.rms_norm_eps == 1e-3
    with pytest.raises(ValueError, match=r"config_overrides\['rms_norm_epsilon'\]: LlamaConfig has no attribute"):
        HFCausalLM(model_name_or_path=path, config_overrides={"rms_norm_epsilon": 1e-3})
    with pytest.raises(ValueError, match=r"model_kwargs\['torch_dtype'\] is not accepted: set HFCausalLM's dtype"):
        HFCausalLM(model_name_or_path=path, model_kwargs={"torch_dtype": "bfloat16"})


def test_a_bf16_checkpoint_loads_as_float32_unless_asked_and_then_warns(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, torch.bfloat16)
    assert {p.dtype for p in HFCausalLM(model_name_or_path=path).parameters()} == {torch.float32}
    module = HFCausalLM(model_name_or_path=path, dtype="auto", attn_backend="sdpa")
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert weight_dtype_warning(module.model, "bf16-true") is None
    with pytest.warns(UserWarning, match=r"weights are bfloat16 but the Trainer runs precision='32-true'"):
        _fit(module, steps=1, precision="32-true")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(HFCausalLM(model_name_or_path=path, dtype="bfloat16", attn_backend="sdpa"), precision="bf16-true")
    assert not [w for w in caught if "trainable weights are" in str(w.message)]  # an explicit choice: no warning


def test_lora_from_a_dict_trains_only_the_adapters_and_packing_stays_exact(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    module = HFCausalLM(model_name_or_path=_checkpoint(tmp_path), peft_config=LORA, lr=1e-2, attn_backend="sdpa")
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    _fit(module)  # the isolation probe runs on the LoRA model at the first step
    assert all(torch.equal(p, frozen[n]) for n, p in module.named_parameters() if n in frozen)
    assert any(torch.count_nonzero(p) for n, p in module.named_parameters() if "lora_B" in n)  # adapters moved
    module.export_hf(tmp_path / "merged")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager")
    _assert_per_document_logits(module, reference, _docs(seed=3))


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_export_loads_with_plain_transformers_and_gives_the_trained_logits(tmp_path: Path, implementation: str) -> None:
    module = HFCausalLM(config=LLAMA, lr=1e-2, attn_backend="sdpa")
    _fit(module)
    out = module.export_hf(tmp_path / "hf")
    assert "lit_seqpack" not in (out / "config.json").read_text()
    assert module.model.config._attn_implementation == "lit_seqpack_varlen"  # the live model is still prepared
    reference = AutoModelForCausalLM.from_pretrained(out, attn_implementation=implementation)
    _assert_per_document_logits(module, reference, _docs(seed=4))


def test_the_export_subcommand_writes_a_folder_from_a_lightning_checkpoint(tmp_path: Path, capsys: Any) -> None:
    pytest.importorskip("peft")
    path = _checkpoint(tmp_path, tokenizer=True)
    module = HFCausalLM(model_name_or_path=path, peft_config=LORA, lr=1e-2, attn_backend="sdpa")
    trainer = _fit(module)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    main(["export", "--ckpt_path", str(tmp_path / "last.ckpt"), "--output_dir", str(tmp_path / "out"), "--dtype",
          "bfloat16"])  # fmt: skip
    assert "exported LlamaForCausalLM (PEFT adapters merged)" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").convert_tokens_to_ids("t5") == 5
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    with torch.no_grad():
        doc = _docs()[0]
        expected = module.eval().seqpack_forward(documents_batch([doc]))[0]
        torch.testing.assert_close(reference(input_ids=doc[None]).logits[0], expected, atol=5e-2, rtol=5e-2)


def test_gpt2_attention_dropout_is_refused_on_packed_rows_naming_its_config_key() -> None:
    gpt2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 128}
    module = HFCausalLM(config=gpt2, attn_backend="sdpa")
    with pytest.raises(ValueError, match=r"\(attn_pdrop=0\.1\).*config_overrides: \{attn_pdrop: 0\.0\}") as err:
        module.train().training_step(documents_batch(_docs()), 0)
    assert "resid_pdrop" not in str(err.value)
    fixed = HFCausalLM(config=gpt2, config_overrides={"attn_pdrop": 0.0}, attn_backend="sdpa")
    fixed.train().training_step(documents_batch(_docs()), 0).backward()


def test_lora_is_set_from_yaml_through_the_cli(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("peft")
    from lit_seqpack.cli import SeqPackCLI

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "hf_llama.yaml"
    lora = "{r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj]}"
    cli = SeqPackCLI(args=["--config", str(config), f"--model.init_args.peft_config={lora}"], run=False)
    trainable = [n for n, p in cli.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert cli.model.hparams.peft_config["r"] == 4 and cli.model.hparams.dtype == "float32"
