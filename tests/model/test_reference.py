from __future__ import annotations

import pytest
import torch

from lit_seqpack.data.batching.collate import PackedCollator, PaddedCollator
from lit_seqpack.model.attention import override_backend
from lit_seqpack.model.attention_reference import reference_flash_attn_varlen_func
from lit_seqpack.model.reference import REFERENCE_PRESETS, ReferenceConfig, ReferenceDecoder

LENGTHS = [3, 9, 1, 6, 5]


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return ReferenceDecoder(ReferenceConfig.preset("tiny", **overrides)).eval()


def _docs(lengths=LENGTHS, vocab=128, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def _alone(model, docs):
    return [model(doc[None])[0] for doc in docs]


def _packed_forward(model, docs, **collator_kwargs):
    batch = PackedCollator(**collator_kwargs)([{"input_ids": doc} for doc in docs])
    logits = model(
        batch["input_ids"],
        position_ids=batch["position_ids"],
        cu_seqlens=batch["cu_seqlens"],
        max_seqlen=batch["max_seqlen"],
    )
    return logits[0], batch["cu_seqlens"].tolist()


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": False}, {"n_kv_head": 4}, {"n_kv_head": 1}])
def test_packed_logits_equal_per_document_logits(overrides):
    model, docs = _model(**overrides), _docs()
    with torch.no_grad():
        packed, cu = _packed_forward(model, docs, pad_to_multiple_of=16)
        for i, alone in enumerate(_alone(model, docs)):
            torch.testing.assert_close(packed[cu[i] : cu[i + 1]], alone, atol=1e-5, rtol=0)
    assert cu[-1] == 32 and len(cu) == len(docs) + 2  # a padding tail was packed too


def test_packed_logits_through_the_flash_attn_route_equal_per_document_logits():
    model, docs = _model(), _docs()
    with torch.no_grad(), override_backend("flash_attn", reference_flash_attn_varlen_func):
        packed, cu = _packed_forward(model, docs)
        alone = _alone(model, docs)
    for i, expected in enumerate(alone):
        torch.testing.assert_close(packed[cu[i] : cu[i + 1]], expected, atol=1e-5, rtol=0)


def test_per_document_padding_keeps_real_logits():
    model, docs = _model(), _docs()
    with torch.no_grad():
        batch = PackedCollator(pad_document_to_multiple_of=4)([{"input_ids": d} for d in docs])
        packed = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])[0]
        cu = batch["cu_seqlens"].tolist()
        for i, alone in enumerate(_alone(model, docs)):
            torch.testing.assert_close(packed[cu[i] : cu[i] + len(docs[i])], alone, atol=1e-5, rtol=0)


def test_default_packed_positions_restart_at_every_document():
    model, docs = _model(), _docs()
    batch = PackedCollator()([{"input_ids": d} for d in docs])
    with torch.no_grad():
        explicit = model(batch["input_ids"], position_ids=batch["position_ids"], cu_seqlens=batch["cu_seqlens"])
        derived = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
    assert torch.equal(explicit, derived)


def test_gradient_never_crosses_documents():
    model, docs = _model(), _docs()
    batch = PackedCollator()([{"input_ids": d} for d in docs])
    captured = {}

    def keep_embeddings(module, args, output):
        output.retain_grad()
        captured["embeddings"] = output

    model.embed_tokens.register_forward_hook(keep_embeddings)
    logits = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], max_seqlen=batch["max_seqlen"])
    cu = batch["cu_seqlens"].tolist()
    target = 1  # the loss of the second document only
    logits[0, cu[target] : cu[target + 1]].logsumexp(-1).sum().backward()
    grad = captured["embeddings"].grad[0]
    assert torch.count_nonzero(grad[: cu[target]]) == 0 and torch.count_nonzero(grad[cu[target + 1] :]) == 0
    assert torch.count_nonzero(grad[cu[target] : cu[target + 1]]) > 0


def test_padded_logits_equal_per_document_logits_on_real_positions():
    model, docs = _model(), _docs()
    batch = PaddedCollator(pad_to_multiple_of=4)([{"input_ids": d} for d in docs])
    with torch.no_grad():
        logits = model(batch["input_ids"], position_ids=batch["position_ids"], attention_mask=batch["attention_mask"])
        for i, alone in enumerate(_alone(model, docs)):
            torch.testing.assert_close(logits[i, : len(docs[i])], alone, atol=1e-5, rtol=0)
    assert torch.isfinite(logits).all()


def test_fully_padded_row_stays_finite():
    model = _model()
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    assert torch.isfinite(model(ids, attention_mask=mask)).all()


def test_without_padding_mask_equals_all_ones_mask():
    model, ids = _model(), torch.stack(_docs([7, 7]))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), model(ids, attention_mask=torch.ones_like(ids)), atol=1e-6, rtol=0)


def test_initialisation_is_deterministic_given_the_seed():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    assert torch.equal(a.layers[0].attn_norm.weight, torch.ones(32))
    assert a.layers[0].attn.o_proj.weight.std() < a.layers[0].attn.q_proj.weight.std()  # scaled output init


@pytest.mark.parametrize("name", sorted(REFERENCE_PRESETS))
@pytest.mark.parametrize("tie", [True, False])
def test_presets_and_parameter_count(name, tie):
    config = ReferenceConfig.preset(name, tie_embeddings=tie)
    with torch.device("meta"):
        model = ReferenceDecoder(config)
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    if name == "100m":
        assert 95e6 < config.num_parameters() < 105e6 if tie else config.num_parameters() > 120e6
    assert (model.lm_head is None) == tie


def test_tied_embeddings_share_the_output_projection():
    model = _model()
    logits = model(torch.tensor([[1, 2, 3]]))
    hidden = model.norm(model.embed_tokens(torch.tensor([[1, 2, 3]])))
    assert logits.shape == (1, 3, 128) and hidden.shape == (1, 3, 32)
    assert not any(p is not model.embed_tokens.weight and p.shape == (128, 32) for p in model.parameters())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_embd": 30}, "must split into n_head=4 heads of even size"),
        ({"n_embd": 12}, "heads of even size"),
        ({"n_kv_head": 3}, "n_kv_head=3 must divide n_head=4"),
        ({"n_layer": 0}, "n_layer must be an int >= 1, got 0"),
        ({"vocab_size": 1.5}, "vocab_size must be an int >= 1, got 1.5"),
        ({"norm_eps": 0.0}, "norm_eps must be a positive finite number"),
        ({"rope_theta": float("nan")}, "rope_theta must be a positive finite number"),
    ],
)
def test_bad_config_names_the_knob(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReferenceConfig.preset("tiny", **kwargs)
    with pytest.raises(ValueError, match="preset=.huge. must be one of"):
        ReferenceConfig.preset("huge")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m: m(torch.zeros(5, dtype=torch.long)), "input_ids must be \\[batch, length\\]"),
        (
            lambda m: m(torch.zeros(2, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)),
            "[1, T]",
        ),
        (
            lambda m: m(
                torch.zeros(1, 4, dtype=torch.long),
                cu_seqlens=torch.tensor([0, 4], dtype=torch.int32),
                attention_mask=torch.ones(1, 4),
            ),
            "no attention_mask",
        ),
        (lambda m: m(torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 3)), "attention_mask must be"),
        (lambda m: m(torch.zeros(1, 4, dtype=torch.long), position_ids=torch.zeros(1, 3)), "position_ids must match"),
        (lambda m: m(torch.zeros(1, 9, dtype=torch.long)), "exceeds max_seq_len=8"),
    ],
)
def test_bad_forward_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(_model(max_seq_len=8))


def test_packed_forward_and_backward_run_under_bf16_autocast():
    """RoPE tables are float32; q and k must stay in the autocast dtype so varlen attention sees one dtype."""
    from lit_seqpack.model.reference import ReferenceConfig, ReferenceDecoder

    torch.manual_seed(0)
    model = ReferenceDecoder(ReferenceConfig(vocab_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    ids = torch.randint(0, 32, (1, 12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, cu_seqlens=cu, max_seqlen=7)
    logits.float().sum().backward()
    assert torch.isfinite(logits.float()).all()
