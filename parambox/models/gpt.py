"""``gpt``, ``gpt-6m``, ``gpt-25m``: a GPT-style decoder over bytes (vocabulary 256), as nanoGPT writes it.

Token and position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x MLP, a final
LayerNorm and an output layer tied to the token embedding (one weight, two uses). The context is the
data set's sample length (``text``: 128 bytes). As an ``nn.Sequential`` of ``Embedding``, the blocks
and ``Head``, a pipeline cuts between blocks. Sizes at context 128 (parameters, float32 MB):

- ``gpt``: width 128, 5 layers, 4 heads: 1,040,768 (4.2 MB), for tests and laptops;
- ``gpt-6m``: width 256, 8 layers, 8 heads: 6,416,896 (25.7 MB);
- ``gpt-25m``: width 512, 8 layers, 8 heads: 25,416,704 (101.7 MB).

Inputs are byte indices of any integer dtype (the ``text`` data set gives int64, a user may keep uint8); the output
is ``(batch, time, 256)`` logits. No dropout: runs stay deterministic and comparable across strategies.

>>> model = gpt((16,), 256)
>>> model(torch.zeros(2, 16, dtype=torch.uint8)).shape
torch.Size([2, 16, 256])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parambox.errors import UserError
from parambox.models.registry import MODELS, register

VOCAB = 256  # bytes


@dataclass(frozen=True)
class GPTSize:
    width: int
    layers: int
    heads: int


SIZES = {
    "gpt": GPTSize(128, 5, 4),
    "gpt-6m": GPTSize(256, 8, 8),
    "gpt-25m": GPTSize(512, 8, 8),
}


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(B, T)`` byte indices -> ``(B, T, width)``."""

    def __init__(self, vocab: int, width: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(context, width))
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.shape[-1] > len(self.pos):
            raise ValueError(
                f"a sequence of {idx.shape[-1]} tokens is longer than the context {len(self.pos)}"
            )
        return self.tok(idx.long()) + self.pos[: idx.shape[-1]]


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``.

    ``mask_buffer``: causality from an additive ``-inf`` mask registered as a buffer (the classic
    nanoGPT ``register_buffer("bias", torch.tril(...))`` form) instead of ``is_causal``; the same
    function, kept so runs can check that a constant non-finite buffer trains under every strategy.
    """

    def __init__(self, width: int, heads: int, context: int, mask_buffer: bool = False):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        if mask_buffer:
            above = torch.ones(context, context, dtype=torch.bool).triu(1)
            self.register_buffer("mask", torch.zeros(context, context).masked_fill(above, float("-inf")))
        else:
            self.mask = None

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:t, :t].to(q.dtype))
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final LayerNorm and the output layer, whose weight is the token embedding's (tied) or its own."""

    def __init__(self, width: int, embedding: Embedding, tied: bool = True):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        if tied:
            self.weight = embedding.tok.weight
        else:
            self.weight = nn.Parameter(torch.empty_like(embedding.tok.weight))
            nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(x), self.weight)


def build_gpt(
    size: str | GPTSize = "gpt",
    context: int = 128,
    vocab: int = VOCAB,
    mask_buffer: bool = False,
    tied: bool = True,
) -> nn.Sequential:
    """A GPT of a named size (``SIZES``) or a ``GPTSize``; for a factory of one's own:
    ``parambox.train(model=lambda: build_gpt("gpt", 128, mask_buffer=True), data="text")``.

    ``tied=False``: the output layer has a weight of its own (``vocab x width`` more parameters). A
    pipeline that puts the tied embedding and head on different ranks keeps a copy on each and adds
    up their gradients across those stages (``strategies/pipeline``)."""
    s = SIZES[size] if isinstance(size, str) else size
    if s.width % s.heads:
        raise ValueError(f"GPT width {s.width} is not a multiple of its {s.heads} heads")
    embedding = Embedding(vocab, s.width, context)
    blocks = [Block(s.width, s.heads, context, mask_buffer) for _ in range(s.layers)]
    head = Head(s.width, embedding, tied)
    model = nn.Sequential(embedding, *blocks, head)
    _init_residuals(model, s.layers)
    return model


def gpt_with_mask_buffer() -> nn.Sequential:
    """``gpt`` at the ``text`` context whose causal masks are ``-inf`` buffers: a model factory for
    ``parambox train --model parambox.models.gpt:gpt_with_mask_buffer --data text``."""
    return build_gpt("gpt", 128, mask_buffer=True)


def gpt_untied() -> nn.Sequential:
    """``gpt`` at the ``text`` context with an output layer of its own (no tied embedding). ``--model
    parambox.models.gpt:gpt_untied --data text``."""
    return build_gpt("gpt", 128, tied=False)


def _init_residuals(model: nn.Sequential, layers: int) -> None:
    # GPT-2's initialisation: linear weights N(0, 0.02), the projections into the residual stream
    # scaled by 1/sqrt(2 * layers) so its variance does not grow with depth.
    for name, p in model.named_parameters():
        if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
            nn.init.normal_(p, std=0.02 / (2 * layers) ** 0.5)
        elif p.dim() == 2 and ("qkv" in name or "mlp.0" in name):
            nn.init.normal_(p, std=0.02)
        elif name.endswith(".bias") and ("qkv" in name or "proj" in name or "mlp" in name):
            nn.init.zeros_(p)


def _builder(size: str):
    def build(input_shape: tuple[int, ...], num_classes: int, mask_buffer: bool = False) -> nn.Sequential:
        if len(input_shape) != 1 or num_classes != VOCAB:
            raise UserError(
                f"model {size!r} needs sequences of bytes, samples of shape (T,) over {VOCAB} classes; "
                f"the data set has samples of shape {tuple(input_shape)} and {num_classes} classes: "
                "use --data text"
            )
        return build_gpt(size, input_shape[0], VOCAB, mask_buffer)

    build.__name__ = build.__qualname__ = size.replace("-", "_")
    build.__doc__ = f"``{size}`` ({SIZES[size]}) at the data set's context."
    return build


for _size in SIZES:
    register(_size, data="text")(_builder(_size))
gpt = MODELS["gpt"]
