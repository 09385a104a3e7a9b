"""A small Llama-style decoder built on :func:`~lit_seqpack.model.attention.varlen_attention`.

Pre-norm blocks of RMSNorm, grouped-query attention with rotary position embeddings (RoPE, read from
``position_ids``, so positions that restart per document give every document of a packed row exactly the
encoding it gets alone) and a SwiGLU MLP; no biases; input and output embeddings tied by default
(``tie_embeddings=False`` unties them). The demo, the tests and the GPU benchmark use it; any Hugging Face causal
LM goes through :mod:`lit_seqpack.model.hf` instead.

Two batch formats, the batch contract's:

* packed: ``input_ids [1, T]`` with ``cu_seqlens``: attention runs per document through ``varlen_attention``;
* padded: ``input_ids [B, L]`` with an optional ``attention_mask``: one SDPA call per layer. A batch padded on the
  right (every row its real tokens, then padding: what the library's collators make) runs with ``is_causal`` and no
  mask, exact for every real token (:func:`~lit_seqpack.batch.is_right_padded`); any other mask (left
  padding, holes) becomes a dense causal and padding mask ``[B, 1, L, L]``. Logits at padding positions are not
  defined (they differ between the two); labels are -100 there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from lit_seqpack._checks import check_choice, check_int
from lit_seqpack.batch import is_right_padded
from lit_seqpack.model.attention import varlen_attention

__all__ = ["REFERENCE_PRESETS", "ReferenceConfig", "ReferenceDecoder"]

REFERENCE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 128, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64},
    "demo": {"vocab_size": 512, "n_layer": 4, "n_head": 4, "n_kv_head": 2, "n_embd": 128, "intermediate_size": 352},
    "100m": {
        "vocab_size": 32000,
        "n_layer": 12,
        "n_head": 12,
        "n_kv_head": 4,
        "n_embd": 768,
        "intermediate_size": 2048,
    },
    "1b": {  # TinyLlama's shape, embeddings tied
        "vocab_size": 32000,
        "n_layer": 22,
        "n_head": 32,
        "n_kv_head": 4,
        "n_embd": 2048,
        "intermediate_size": 5632,
    },
}
"""Named sizes: ``tiny`` for unit tests, ``demo`` for the CPU demo, ``100m`` (~100M parameters) and ``1b`` (~1.03B,
TinyLlama's shape with tied embeddings; ``benchmarks/gpu.py``) for GPU runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReferenceConfig:
    """Sizes of a :class:`ReferenceDecoder`.

    Args:
        vocab_size: number of token ids.
        n_layer: transformer blocks.
        n_head: query heads.
        n_kv_head: key/value heads; divides ``n_head`` (``n_kv_head < n_head`` is grouped-query attention).
        n_embd: model width; ``n_embd / n_head`` (the head size) must be even for RoPE.
        intermediate_size: hidden width of the SwiGLU MLP.
        rope_theta: RoPE base.
        max_seq_len: the longest row the model accepts.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: share the input embedding with the output projection.
        init_std: standard deviation of the normal initialisation (output projections of each block get
            ``init_std / sqrt(2 * n_layer)``).

    Example:
        >>> ReferenceConfig.preset("tiny").head_dim
        8
    """

    vocab_size: int = 512
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 2
    n_embd: int = 128
    intermediate_size: int = 352
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "max_seq_len"):
            check_int(name, getattr(self, name), minimum=1)
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")

    @classmethod
    def preset(cls, name: str, **overrides: object) -> ReferenceConfig:
        """A named size from :data:`REFERENCE_PRESETS`, with ``overrides`` applied."""
        check_choice("preset", name, sorted(REFERENCE_PRESETS))
        return cls(**(REFERENCE_PRESETS[name] | overrides))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds."""
        attention = self.n_embd * self.head_dim * (2 * self.n_head + 2 * self.n_kv_head)
        block = attention + 3 * self.n_embd * self.intermediate_size + 2 * self.n_embd
        embeddings = self.vocab_size * self.n_embd * (1 if self.tie_embeddings else 2)
        return self.n_layer * block + embeddings + self.n_embd

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotary(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """``[2, B, T, 1, head_dim]`` cos and sin for every position (computed in float32)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return torch.stack([angles.cos(), angles.sin()]).to(dtype)


def _apply_rotary(x: torch.Tensor, rotary: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    rotary = rotary.to(x.dtype)  # under autocast q/k are half precision while the tables are float32
    return x * rotary[0] + rotated * rotary[1]


class _Attention(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, attention: dict[str, object]) -> torch.Tensor:
        batch, length, _ = x.shape
        q = _apply_rotary(self.q_proj(x).view(batch, length, self.n_head, self.head_dim), rotary)
        k = _apply_rotary(self.k_proj(x).view(batch, length, self.n_kv_head, self.head_dim), rotary)
        v = self.v_proj(x).view(batch, length, self.n_kv_head, self.head_dim)
        if attention["cu_seqlens"] is not None:
            out = varlen_attention(q[0], k[0], v[0], attention["cu_seqlens"], attention["max_seqlen"], causal=True,
                                   backend=attention["backend"])[None]  # fmt: skip
        else:
            mask = attention["mask"]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
            out = out.transpose(1, 2)
        return self.o_proj(out.reshape(batch, length, self.n_head * self.head_dim))


class _Block(nn.Module):
    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attn = _Attention(config)
        self.mlp_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, rotary: torch.Tensor, attention: dict[str, object]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rotary, attention)
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class ReferenceDecoder(nn.Module):
    """Llama-style causal LM over packed or padded batches; see the module docstring.

    Initialisation is deterministic given ``torch.manual_seed``.

    Args:
        config: the sizes.

    Example:
        >>> model = ReferenceDecoder(ReferenceConfig.preset("tiny"))
        >>> ids = torch.tensor([[5, 6, 7, 8, 9]])
        >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> model(ids, cu_seqlens=cu, max_seqlen=3).shape
        torch.Size([1, 5, 128])
    """

    def __init__(self, config: ReferenceConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, output projections scaled by ``1 / sqrt(2 * n_layer)``, norms at one."""
        std = self.config.init_std
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                scaled = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, std=std / math.sqrt(2 * self.config.n_layer) if scaled else std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_backend: str = "auto",
    ) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]``; ``logits[:, t]`` predicts token ``t + 1``: :meth:`output_weight` applied to
        :meth:`hidden_states` (same arguments)."""
        hidden = self.hidden_states(
            input_ids,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            attention_mask=attention_mask,
            attn_backend=attn_backend,
        )
        return self.lm_head(hidden) if self.lm_head is not None else F.linear(hidden, self.embed_tokens.weight)

    def output_weight(self) -> torch.Tensor:
        """The output projection's weight ``[vocab_size, n_embd]`` (the input embedding's when tied)."""
        return self.lm_head.weight if self.lm_head is not None else self.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_backend: str = "auto",
    ) -> torch.Tensor:
        """The last hidden states ``[B, T, n_embd]`` (after the final norm), before the output projection.

        Args:
            input_ids: ``[B, T]`` token ids.
            position_ids: ``[B, T]``; default ``0..T-1`` per row, or restarting at every ``cu_seqlens`` boundary.
            cu_seqlens: int32 document boundaries of a packed row (``B`` must be 1).
            max_seqlen: the longest document of the packed row (read from ``cu_seqlens`` if omitted: a sync).
            attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (padded batches only). Right padding needs
                no mask (causal attention is exact for the real tokens; checked once per call, one device read when
                the mask is on an accelerator); any other layout is masked densely.
            attn_backend: :func:`~lit_seqpack.model.attention.varlen_attention` backend of packed rows.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(input_ids.shape)}")
        batch, length = input_ids.shape
        if length > self.config.max_seq_len:
            raise ValueError(f"row length {length} exceeds max_seq_len={self.config.max_seq_len}")
        attention: dict[str, object] = {"cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen, "backend": attn_backend}
        if cu_seqlens is not None:
            if batch != 1 or attention_mask is not None:
                raise ValueError(
                    f"a packed row (cu_seqlens given) needs input_ids [1, T] and no attention_mask, got batch={batch}"
                    f" and attention_mask={'set' if attention_mask is not None else None}"
                )
            seqlens = cu_seqlens[1:] - cu_seqlens[:-1]
            if max_seqlen is None:
                attention["max_seqlen"] = int(seqlens.max())
            if position_ids is None:
                starts = torch.repeat_interleave(cu_seqlens[:-1].long(), seqlens, output_size=length)
                position_ids = (torch.arange(length, device=input_ids.device) - starts)[None]
        else:
            attention["mask"] = self._padding_mask(attention_mask, batch, length)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device).expand(batch, length)
        if position_ids.shape != input_ids.shape:
            raise ValueError(f"position_ids must match input_ids {tuple(input_ids.shape)}, got {position_ids.shape}")
        x = self.embed_tokens(input_ids)
        rotary = _rotary(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, rotary, attention)
        return self.norm(x)

    @staticmethod
    def _padding_mask(attention_mask: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
        """The SDPA mask of a padded batch: ``None`` (causal) without a mask or with right padding, else dense."""
        if attention_mask is None:
            return None
        if attention_mask.shape != (batch, length):
            raise ValueError(f"attention_mask must be [{batch}, {length}], got {tuple(attention_mask.shape)}")
        if is_right_padded(attention_mask):
            return None
        return ReferenceDecoder._dense_mask(attention_mask, length)

    @staticmethod
    def _dense_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, 1, L, L]`` boolean mask: causal, real keys only, and every position may see itself (so a padding
        row is never fully masked, which would make SDPA return NaN)."""
        idx = torch.arange(length, device=attention_mask.device)
        causal = idx[:, None] >= idx[None, :]
        allowed = (causal & attention_mask.bool()[:, None, :]) | (idx[:, None] == idx[None, :])
        return allowed[:, None]
