"""The tiny random transformers decoder shared by the HF tests (2 layers, width 32, grouped-query attention)."""

TINY_HF = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
"""``AutoConfig.for_model`` keyword arguments; a test adds what its architecture needs (``head_dim``, windows)."""
