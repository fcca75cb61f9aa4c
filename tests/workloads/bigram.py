"""A bigram model of bytes: one row of next-byte logits per byte (65,536 parameters), zero at the start
(perplexity 256). Its logits are the table times ``SCALE``, so plain SGD at the default run's rate (0.03,
momentum 0.9) takes it in a few dozen steps below the bytes' unigram perplexity (26): a sequence workload
whose metric falls, cheap enough for CLI tests of lower-is-better targets."""

import torch
from torch import nn

SCALE = 6.0


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.zeros(256, 256))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx.long()] * SCALE


def model() -> nn.Module:
    return Bigram()
