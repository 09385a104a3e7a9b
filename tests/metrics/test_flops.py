"""training_flops: the causal per-document attention term, the linear term, and only real tokens counted."""

from __future__ import annotations

import pytest
import torch

from lit_seqpack.metrics.flops import PEAK_FLOPS, FlopCount, device_peak_flops, document_lengths, training_flops
from lit_seqpack.model.lm import ReferenceLM
from lit_seqpack.model.reference import ReferenceConfig

SIZES = dict(vocab_size=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=48)


def test_attention_term_is_6_layers_width_sum_of_squares_for_reference_lm() -> None:
    lm = ReferenceLM(**SIZES)
    lengths = [7, 1, 30, 12]
    count = FlopCount.of(lm)
    assert count.attention(lengths) == 6 * 3 * 32 * sum(n * n for n in lengths)
    config = ReferenceConfig(**SIZES)
    # N: every parameter but the input embedding, plus the tied output projection (a matmul all the same)
    assert count.active_parameters == config.num_parameters()
    assert count.active_parameters == sum(p.numel() for p in lm.parameters())
    untied = FlopCount.of(ReferenceLM(**SIZES, tie_embeddings=False))
    assert untied.active_parameters == config.num_parameters()  # the lookup left out, the head counted once
    assert training_flops(lm, lengths) == 6 * config.num_parameters() * 50 + count.attention(lengths)


def test_two_documents_of_l_count_twice_one() -> None:
    lm = ReferenceLM(**SIZES)
    for length in (1, 16, 100):
        assert training_flops(lm, [length, length]) == 2 * training_flops(lm, [length])
    assert training_flops(lm, [32]) > 2 * training_flops(lm, [16])  # one long document is more attention work


def _packed_and_padded(docs: list[list[int]]) -> tuple[dict, dict]:
    from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator

    samples = [{"input_ids": doc} for doc in docs]
    return PackedCollator(pad_to_multiple_of=16)(samples), PaddedCollator(pad_to_multiple_of=16)(samples)


def test_a_padded_batch_of_the_same_documents_counts_the_same() -> None:
    lm = ReferenceLM(**SIZES)
    docs = [list(range(1, n + 1)) for n in (5, 11, 3)]
    packed, padded = _packed_and_padded(docs)
    assert packed["num_padding_tokens"] > 0 and padded["num_padding_tokens"] > 0  # padding tail / padded rows
    assert document_lengths(packed).tolist() == document_lengths(padded).tolist() == [5, 11, 3]
    flops = {training_flops(lm, document_lengths(b)) for b in (packed, padded)}
    assert flops == {training_flops(lm, [5, 11, 3])}


def test_hf_configs_are_read_windows_and_experts() -> None:
    pytest.importorskip("transformers")
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **sizes, tie_word_embeddings=False))
    count = FlopCount.of(llama)
    assert count.attention_layers == ((32, None), (32, None))
    embedding = llama.get_input_embeddings().weight.numel()
    assert count.active_parameters == sum(p.numel() for p in llama.parameters()) - embedding
    mistral = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", **sizes, sliding_window=8))
    windowed = FlopCount.of(mistral)
    assert windowed.attention_layers == ((32, 8), (32, 8))
    assert windowed.attention([8]) == 6 * 2 * 32 * 64 and windowed.attention([20]) == 6 * 2 * 32 * (2 * 20 * 8 - 64)
    mixtral = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("mixtral", **sizes, num_local_experts=4, num_experts_per_tok=1)
    )
    experts = sum(p.numel() for name, p in mixtral.named_parameters() if "experts" in name.split("."))
    dense = sum(p.numel() for p in mixtral.parameters()) - mixtral.get_input_embeddings().weight.numel()
    assert experts > 0 and FlopCount.of(mixtral).active_parameters == dense - experts + experts // 4


def test_a_model_states_its_own_count_and_unknown_models_are_refused() -> None:
    class Stated(torch.nn.Module):
        def training_flops(self, lengths: list[int]) -> int:
            return 1000 * sum(lengths)

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Stated()

    assert training_flops(Wrapper(), [3, 4]) == 7000
    with pytest.raises(ValueError, match="cannot count the FLOPs of Linear.*training_flops"):
        training_flops(torch.nn.Linear(2, 2), [3])
    with pytest.raises(ValueError, match="lengths must be document lengths"):
        training_flops(Wrapper(), [3, -1])


def test_compiled_models_are_followed() -> None:
    lm = ReferenceLM(**SIZES)
    compiled = torch.compile(lm.model, backend="eager")
    assert training_flops(compiled, [9]) == training_flops(lm, [9])


def test_peak_table_and_its_refusals() -> None:
    assert dict(PEAK_FLOPS)["H100"] == dict(PEAK_FLOPS)["H200"] == 989.4e12
    keys = [key for key, _ in PEAK_FLOPS]
    for longer, shorter in (("H100 PCIe", "H100"), ("GH200", "H200"), ("L40S", "L4"), ("A10G", "A10")):
        assert keys.index(longer) < keys.index(shorter)  # the first substring match wins
    with pytest.raises(ValueError, match="CUDA devices only .*peak_flops=<FLOP/s>"):
        device_peak_flops("cpu")


@pytest.mark.gpu
def test_the_cuda_device_is_in_the_peak_table() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert device_peak_flops("cuda") >= 70e12, torch.cuda.get_device_name()
