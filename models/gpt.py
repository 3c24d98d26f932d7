"""A small GPT-style decoder laid out for torchtitan-style tensor and pipeline parallelism.

Layout (the parallel engine relies on these names):
``tok_embeddings`` -> ``layers["0"], layers["1"], ...`` (each with ``attention_norm``, ``attention.{wq,wk,wv,wo}``,
``ffn_norm``, ``feed_forward.{w1,w2}``) -> ``norm`` -> ``output``. ``tok_embeddings``, ``norm`` and ``output`` may
be set to None, and blocks deleted from ``layers``, to make a pipeline stage whose parameter names are those of
the whole model. Positions are encoded with rotary embeddings computed inside each attention layer, so a stage
without ``tok_embeddings`` only needs the hidden states it receives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Sizes of the decoder; ``ffn_hidden`` defaults to 4 * d_model."""

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    ffn_hidden: int | None = None
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        """Validate the fields."""
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by n_head={self.n_head}")
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"the head size d_model/n_head={self.d_model // self.n_head} must be even "
                             "for rotary position embeddings; change d_model or n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.ffn_hidden is not None and self.ffn_hidden <= 0:
            raise ValueError(f"GPTConfig.ffn_hidden must be positive (or None for 4*d_model), got {self.ffn_hidden}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head

    @property
    def hidden_dim(self) -> int:
        """Width of the feed-forward layer."""
        return self.ffn_hidden if self.ffn_hidden is not None else 4 * self.d_model


def apply_rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) queries or keys by their position (RoPE, rotate-half form)."""
    t, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv_freq)  # (t, half)
    cos = angles.cos()[None, :, None, :].to(x.dtype)
    sin = angles.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q/k/v/o projections (heads are shardable)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_head  # informational; forward infers the (possibly sharded) local count
        self.head_dim = config.head_dim
        self.dropout = config.dropout
        self.wq = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=False)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=False)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over (batch, seq, d_model) inputs; each position sees itself and earlier ones only."""
        b, t, _ = x.shape
        q = apply_rotary(self.wq(x).view(b, t, -1, self.head_dim))
        k = apply_rotary(self.wk(x).view(b, t, -1, self.head_dim))
        v = self.wv(x).view(b, t, -1, self.head_dim)
        # Flash attention's conditions on CUDA: no mask tensor (is_causal), unit stride in the last dim (these
        # transposed views have it), bf16/fp16 inputs, head_dim <= 256; dropout it supports. tests/parallel/
        # test_cuda_engine.py forces the flash backend, which raises if any of them breaks.
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, -1)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    """Position-wise w2(gelu(w1(x)))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.d_model, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the two projections with a GELU between them."""
        return self.dropout(self.w2(F.gelu(self.w1(x))))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + feed_forward(norm(.))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Transform hidden states (batch, seq, d_model) without modifying the input."""
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(tokens)`` returns logits (batch, seq, vocab_size).

    In a pipeline stage, a missing ``tok_embeddings`` means the input is already hidden states and a missing
    ``output`` means the hidden states are returned.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layer)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """(Re)initialise parameters GPT-2 style; residual projections scaled by 1/sqrt(2 * n_layer).

        Skips modules that are None, so it also works on a pipeline stage or after ``to_empty`` from meta.
        """
        std = 0.02
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for block in self.layers.values():
            for norm in (block.attention_norm, block.ffn_norm):
                norm.reset_parameters()
            attn, ffn = block.attention, block.feed_forward
            for linear in (attn.wq, attn.wk, attn.wv, ffn.w1):
                nn.init.normal_(linear.weight, mean=0.0, std=std)
            for linear in (attn.wo, ffn.w2):
                nn.init.normal_(linear.weight, mean=0.0, std=std / math.sqrt(2 * self.config.n_layer))
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq); hidden states in/out for pipeline stages."""
        if tokens.shape[1] > self.config.block_size:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds block_size={self.config.block_size}; "
                             "use shorter sequences or build the model with a larger block_size")
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h
