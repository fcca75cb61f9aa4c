"""(b) A small causal transformer language model, written here, on bytes of the Python standard library.

    python examples/transformer_lm.py                   # easgd against allreduce, 2 workers each
    python examples/transformer_lm.py --strategies easgd --workers 4 --steps 2000
    python examples/transformer_lm.py --quick           # what the test suite runs (and checks)

The corpus is the standard library's own ``.py`` files, read as bytes (vocabulary 256), so it exists
offline on every machine; the last 10 % is the test set. The model is a pre-norm GPT: token and
position embeddings, ``--layers`` blocks of causal self-attention and an MLP, and an output layer
tied to the token embedding (one weight, two uses). The loss is the mean next-byte cross-entropy
in nats; a model that only knew byte frequencies would score about 3.2 on this corpus.

Quick form (200 steps, 2 workers x batch 16, contexts of 64 bytes): both strategies reach a test
loss below 2.6 nats/byte (``QUICK_BOUND``, tested); the full form goes well below 2.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import parambox

CONTEXT = 64
CORPUS_BYTES = 1_500_000  # from the first files of the standard library, sorted by name
QUICK_BOUND = 2.6  # test loss (nats/byte) both strategies stay below in the quick form


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(
        self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, context: int = CONTEXT
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.tok.weight  # tied input and output embeddings
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


class ByteWindows(Dataset):
    """Item i: (bytes[i*stride : +CONTEXT], the same shifted by one) as int64 tensors."""

    def __init__(self, data: torch.Tensor, stride: int):
        self.data, self.stride = data, stride

    def __len__(self) -> int:
        return (len(self.data) - CONTEXT - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + CONTEXT + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_bytes(limit: int = CORPUS_BYTES) -> torch.Tensor:
    """The first ``limit`` bytes of the standard library's top-level .py files, in name order."""
    root = Path(os.__file__).parent
    out, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        out.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)[:limit]), dtype=torch.uint8)


def make_data() -> tuple[Dataset, Dataset]:
    data = stdlib_bytes()
    cut = int(len(data) * 0.9)
    # Overlapping training windows (stride 16); disjoint test windows, at most 256 of them.
    test = data[cut : cut + 256 * CONTEXT + 1]
    return ByteWindows(data[:cut], 16), ByteWindows(test, CONTEXT)


def make_model() -> nn.Module:
    return TinyGPT()


def next_byte_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="easgd,allreduce", help="comma list, run one after the other")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--out", default="runs/transformer_lm")
    p.add_argument("--quick", action="store_true", help=f"200 steps; test loss below {QUICK_BOUND}")
    args = p.parse_args()
    results = {}
    for strategy in args.strategies.split(","):
        summary = parambox.train(
            model=make_model,
            data=make_data,
            loss=next_byte_loss,
            strategy=strategy,
            workers=args.workers,
            options={"tau": 4, "alpha": 0.3} if strategy == "easgd" else None,
            steps=200 if args.quick else args.steps,
            batch_size=16,
            optimizer="adam",
            lr=3e-3,
            eval_every=0 if args.quick else 250,
            out=f"{args.out}/{strategy}",
            progress=not args.quick,
        )
        if summary is not None:
            results[strategy] = summary
    for strategy, s in results.items():
        loss = s["final_test_loss"]
        print(
            f"{strategy:>10}: test loss {loss:.3f} nats/byte ({loss / math.log(2):.2f} bits), {s['wall_time_s']:.0f} s"
        )


if __name__ == "__main__":
    main()
