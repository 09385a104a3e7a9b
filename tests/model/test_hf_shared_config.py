"""A reference model built from a prepared policy's config object: the policy's attention switch is named."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from lit_seqpack.model.hf import ATTENTION_NAME  # noqa: E402
from lit_seqpack.model.isolation import documents_batch  # noqa: E402
from lit_seqpack.model.lm import HFCausalLM  # noqa: E402
from tests.model._hf_tiny import TINY_HF  # noqa: E402

CONFIG = {"model_type": "llama", **TINY_HF}


def _batch() -> dict:
    gen = torch.Generator().manual_seed(0)
    return documents_batch([torch.randint(1, 64, (n,), generator=gen) for n in (5, 7, 4)])


def test_a_reference_model_from_the_policy_config_object_names_what_happened() -> None:
    """``from_config(policy.model.config, attn_implementation="eager")`` flips the config the policy shares."""
    policy = HFCausalLM(config=CONFIG)
    policy.train()
    policy.training_step(_batch(), 0)  # packed and exact before
    AutoModelForCausalLM.from_config(policy.model.config, attn_implementation="eager")
    assert policy.model.config._attn_implementation == "eager"  # transformers switched the shared object
    with pytest.raises(ValueError) as caught:
        policy.training_step(_batch(), 0)
    message = str(caught.value)
    assert "the model's config was changed to 'eager' after it was prepared" in message
    assert "build other models from a copy of the config" in message
    assert "AttentionInterface" not in message  # it no longer blames the model


def test_a_reference_model_from_a_copy_of_the_config_leaves_the_policy_packed() -> None:
    policy = HFCausalLM(config=CONFIG)
    policy.train()
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(policy.model.config), attn_implementation="eager")
    assert reference.config._attn_implementation == "eager"
    assert policy.model.config._attn_implementation == ATTENTION_NAME
    loss = policy.training_step(_batch(), 0)
    assert torch.isfinite(loss)
