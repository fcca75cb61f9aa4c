"""Compressed exchanges: ``compression = none | bf16 | int8`` for a flat float32 tensor, with error feedback.

Streaming DiLoCo and SparseLoCo send quantized outer gradients; the error each quantization makes
is kept by the sender and added to its next message (error feedback), so nothing is lost over
rounds, only late. ``int8`` has one float32 scale per block of ``block`` elements (max |x| / 127):
4 + 4/block bytes per 4 bytes of float32, about 0.25x; ``bf16`` is 0.5x.

A message is one ``uint8`` tensor (an exact float32 tail for counts and flags, the int8 scales,
then the codes: the wider types first, so each part's offset suits its type), so one collective
carries it. Sums of int8 codes would overflow and their scales
differ per rank, so compressed messages are gathered (``all_gather``) and every rank decodes and
sums them in float32; uncompressed ones go through ``all_reduce`` as before.

>>> c = Compressor("bf16", numel=4)
>>> msg = c.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
>>> c.decode(msg)[0].tolist(), c.message_bytes(tail=0), Compressor("int8", 1000).message_bytes(0)
([1.0, -0.5, 0.25, 0.0], 8, 1016)
"""

from __future__ import annotations

from typing import Literal

import torch

Compression = Literal["none", "bf16", "int8"]
DEFAULT_BLOCK = 256  # elements per int8 scale: the scales cost 1/64 of the codes
_F32 = 4


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): ``x ~ codes * scale`` per block of ``block`` elements; |error| <= scale / 2.

    >>> codes, scales = quantize_int8(torch.tensor([0.5, -1.0, 2.0]), block=2)
    >>> codes.tolist(), scales.tolist()
    ([64, -127, 127], [0.007874015718698502, 0.015748031437397003])
    """
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    padded = padded.view(blocks, block)
    scales = padded.abs().amax(dim=1) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes.view(-1)[:n], scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values of ``codes`` with one scale per block."""
    n = codes.numel()
    return codes.to(torch.float32) * scales.repeat_interleave(block)[:n]


class Compressor:
    """Encodes one rank's flat float32 tensor for the wire, with error feedback, and decodes messages.

    ``encode(x, tail)`` sends ``x + e`` (``e`` the error left from the last message) and keeps the
    new error; ``tail`` (counts, flags) rides along in float32, exact. ``decode(msg)`` gives back
    ``(x_hat, tail)``. ``none`` sends float32 itself (no error).
    """

    def __init__(
        self,
        mode: Compression,
        numel: int,
        block: int = DEFAULT_BLOCK,
        error_feedback: bool = True,
        device: torch.device | None = None,
    ):
        self.mode, self.numel, self.block = mode, numel, block
        self.num_blocks = -(-numel // block)
        self.error = torch.zeros(numel, device=device) if error_feedback and mode != "none" else None

    def forget_error_(self) -> None:
        """Drop the error carried to the next message (none owed: a fresh start, or nothing sent)."""
        if self.error is not None:
            self.error.zero_()

    def payload_bytes(self) -> int:
        """Bytes of the encoded ``x`` (without the tail)."""
        if self.mode == "none":
            return _F32 * self.numel
        if self.mode == "bf16":
            return 2 * self.numel
        return self.numel + _F32 * self.num_blocks

    def message_bytes(self, tail: int) -> int:
        """Bytes of one message with a float32 tail of ``tail`` elements."""
        return self.payload_bytes() + _F32 * tail

    def encode(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """One message (``uint8``; for ``none`` the float32 concatenation, reduced as is)."""
        tail = torch.zeros(0, device=x.device) if tail is None else tail.reshape(-1).float()
        x = x.reshape(-1)
        if self.mode == "none":
            return torch.cat([x, tail])
        y = x + self.error if self.error is not None else x
        parts = self._codes(y)
        if self.error is not None:
            torch.sub(y, self._decode_parts(parts), out=self.error)
        return torch.cat([tail.view(torch.uint8), *(p.reshape(-1).view(torch.uint8) for p in parts)])

    def decode(self, msg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_hat, tail)`` of a message from any rank (same mode, numel and block)."""
        if self.mode == "none":
            return msg[: self.numel], msg[self.numel :]
        cut = msg.numel() - self.payload_bytes()
        tail, body = msg[:cut].view(torch.float32), msg[cut:]
        if self.mode == "bf16":
            return body.view(torch.bfloat16).float(), tail
        scales = body[: _F32 * self.num_blocks].view(torch.float32)
        codes = body[_F32 * self.num_blocks :].view(torch.int8)
        return dequantize_int8(codes, scales, self.block), tail

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receivers will decode of ``x`` (error feedback applied): for a box that stores float32."""
        return self.decode(self.encode(x))[0]

    def _codes(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.mode == "bf16":
            return (y.to(torch.bfloat16),)
        codes, scales = quantize_int8(y, self.block)
        return scales, codes

    def _decode_parts(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.mode == "bf16":
            return parts[0].float()
        return dequantize_int8(parts[1], parts[0], self.block)
