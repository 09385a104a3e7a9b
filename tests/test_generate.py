"""``lit-seqpack generate`` and ``export`` on checkpoints that ``lit-seqpack fit`` wrote (2 steps of tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_seqpack.__main__ import main
from lit_seqpack.cli import SeqPackCLI
from lit_seqpack.export import export_command
from lit_seqpack.generate import generate_command

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
TINY_HF = (
    '{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, '
    '"num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 1024}'
)
TINY_REFERENCE = [
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=16",
    "--model.init_args.intermediate_size=32",
]

pytestmark = [
    pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended to run from within Python.*"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
]


def _fit(folder: Path, config: str, *overrides: str) -> Path:
    """Two training steps of ``configs/<config>.yaml`` run in ``folder``; its last checkpoint."""
    folder.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        args = ["fit", "--config", str(CONFIGS / f"{config}.yaml"), "--trainer.max_steps=2", *overrides]
        SeqPackCLI(args=args)
    return folder / "outputs" / config / "checkpoints" / "last.ckpt"


@pytest.fixture(scope="module")
def text_checkpoint(tmp_path_factory) -> Path:
    """A ReferenceLM trained on raw text with the chat demo's tokenizer (the run records the tokenizer folder)."""
    return _fit(tmp_path_factory.mktemp("runs") / "text", "text_sft", *TINY_REFERENCE)


def _vocab() -> set[str]:
    from transformers import AutoTokenizer

    return set(AutoTokenizer.from_pretrained(ROOT / "lit_seqpack/data/assets/chat_demo/tokenizer").get_vocab())


def test_generate_prints_text_through_a_reference_lm_checkpoint(text_checkpoint, capsys):
    main(["generate", "--ckpt_path", str(text_checkpoint), "--prompt", "what is 2 plus 3 then", "--max_new_tokens=6"])
    text = capsys.readouterr().out.strip()
    assert text and not text.startswith("#")
    assert set(text.split()) <= _vocab()  # words of the run's tokenizer, decoded


def test_greedy_is_deterministic_and_sampling_honours_the_seed(text_checkpoint):
    args = ["--ckpt_path", str(text_checkpoint), "--prompt", "what is 7 plus", "--max_new_tokens=8"]
    assert generate_command(args) == generate_command(args)
    sampled = [*args, "--temperature=2.0"]
    assert generate_command([*sampled, "--seed=5"]) == generate_command([*sampled, "--seed=5"])
    assert len({generate_command([*sampled, f"--seed={seed}"]) for seed in range(4)}) > 1


def test_a_prompt_file_prints_each_prompt_and_its_text(text_checkpoint, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("what is 1 plus 1 then\n\nwhat is 4 plus 4 then\n")
    lines = generate_command(["--ckpt_path", str(text_checkpoint), "--prompt_file", str(prompts)]).splitlines()
    assert lines[0] == "> what is 1 plus 1 then" and lines[2] == "> what is 4 plus 4 then" and len(lines) == 4


def test_generate_chats_through_an_hf_checkpoint_with_the_runs_tokenizer(tmp_path):
    ckpt = _fit(
        tmp_path / "chat", "chat_sft", "--model=lit_seqpack.model.lm.HFCausalLM", f"--model.init_args.config={TINY_HF}"
    )
    chat = '[{"role": "user", "content": "what is 2 plus 3"}]'
    text = generate_command(["--ckpt_path", str(ckpt), "--chat", chat, "--max_new_tokens=5", "--stop", "<|end|>"])
    assert text and not text.startswith("#") and set(text.split()) <= _vocab()


def test_a_run_without_tokenizer_generates_token_ids_and_says_why(tmp_path):
    overrides = ["--model.init_args.config.hidden_size=16", "--model.init_args.config.num_hidden_layers=1"]
    ckpt = _fit(tmp_path / "hf", "hf_llama", "--data.source.init_args.num_samples=200", *overrides)
    note, ids = generate_command(["--ckpt_path", str(ckpt), "--prompt", "5 9 3", "--max_new_tokens=4"]).splitlines()
    assert note.startswith("# token ids:") and "--tokenizer" in note
    assert len(ids.split()) == 4 and all(0 <= int(i) < 64 for i in ids.split())
    with pytest.raises(ValueError, match="without a tokenizer a prompt is token ids"):
        generate_command(["--ckpt_path", str(ckpt), "--prompt", "what is"])


def test_export_writes_a_reference_lm_as_a_plain_folder_that_loads_back(text_checkpoint, tmp_path, capsys):
    from lit_seqpack.export import load_module
    from lit_seqpack.model.lm import load_reference_lm

    main(["export", "--ckpt_path", str(text_checkpoint), "--output_dir", str(tmp_path / "model")])
    assert "exported ReferenceLM" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "model").iterdir()}
    trained, loaded = load_module(text_checkpoint), load_reference_lm(tmp_path / "model")
    ids = torch.tensor([[2, 60, 53, 12, 56, 13]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), trained(ids), rtol=0, atol=0)


def test_a_checkpoint_of_an_unknown_class_is_refused_saying_what_to_pass(tmp_path):
    path = tmp_path / "other.ckpt"
    torch.save({"hyper_parameters": {"_class_path": "my_pkg.MyModel", "width": 3}, "state_dict": {}}, path)
    for command in (generate_command, export_command):
        extra = ["--prompt", "1 2"] if command is generate_command else ["--output_dir", str(tmp_path / "out")]
        with pytest.raises(ValueError, match="trained with my_pkg.MyModel.*pass --model_class my_pkg.MyModel"):
            command(["--ckpt_path", str(path), *extra])
    with pytest.raises(FileNotFoundError, match="outputs/<config name>/checkpoints"):
        generate_command(["--ckpt_path", str(tmp_path / "missing.ckpt"), "--prompt", "1"])
