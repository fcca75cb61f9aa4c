"""Compressed exchanges of a flat float32 tensor, with error feedback.

``compression = none | bf16 | int8 | int4 | int2 | sign | topk | powersgd``. The error each encoding makes is
kept by the sender and added to its next message (error feedback), so nothing is lost over rounds,
only late: the sum of what was sent plus the error still owed is the sum of what was meant.

Bytes per float32 element (block ``b`` elements per float32 scale, default 256; ``r`` the ratio):

- ``bf16``: 2 (0.5x). ``int8``: 1 + 4/b (about 0.25x), scale ``max|x| / 127`` per block.
- ``int4``: 1/2 + 4/b (about 1/8), codes in [-7, 7], scale ``max|x| / 7``; ``int2``: 1/4 + 4/b (about
  1/16), codes in [-1, 1], scale ``max|x|``: SparseLoCo's and MuLoCo's 2-4-bit outer gradients.
- ``sign``: 1/8 + 4/b (about 1/32 plus the scales): one bit per element, decoded as ``+-scale`` with
  the block's mean ``|x|`` as scale (signSGD with error feedback; 1-bit Adam's scaled sign).
- ``topk``: 8 r (0.02x at r = 1 %): the ``k = ceil(r n)`` largest ``|x + e|`` as int32 indices and
  float32 values, the rest left in the error (BytePS's and Deep Gradient Compression's top-k).

A message is one ``uint8`` tensor (an exact float32 tail for counts and flags, the float32 scales
or values, then the codes or indices: the wider types first, so each part's offset suits its type),
so one collective carries it. Compressed messages are gathered (``all_gather``) and every rank
decodes and sums them in float32; uncompressed ones go through ``all_reduce`` as before.

Over a box (``round_trip``) the sender quantizes the pushed update with its own error feedback and
the box stores float32: the "server-side" error feedback of 1-bit schemes (a second compression of
the box's reply, with the box's own error) is not in scope. :class:`PushEncoder` (downpour's and
asynchronous easgd's pushes, asynchronous diloco's arrivals) sends the messages themselves
(``ParameterBox.push_encoded_async``, ``outer_step_encoded_async``): the rma box's memory server decodes
them with this module's decoder (``WIRE_MODES``, set on import), so the codes cross the link.

``powersgd`` (:mod:`parambox.strategies.powersgd`) is not a per-rank message: it needs two allreduces
and a Q shared by the ranks per round, so it compresses allreduce's gradients and synchronous diloco's outer gradients only; this module's
:class:`Compressor` takes the other modes.

>>> c = Compressor("bf16", numel=4)
>>> msg = c.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
>>> c.decode(msg)[0].tolist(), c.message_bytes(tail=0), Compressor("int8", 1000).message_bytes(0)
([1.0, -0.5, 0.25, 0.0], 8, 1016)
>>> Compressor("sign", 4).round_trip(torch.tensor([1.0, -3.0, 2.0, -2.0])).tolist()
[2.0, -2.0, 2.0, -2.0]
>>> Compressor("topk", 4, ratio=0.5).round_trip(torch.tensor([1.0, -3.0, 2.0, 0.5])).tolist()
[0.0, -3.0, 2.0, 0.0]
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from parambox.box.base import set_decoder

Compression = Literal["none", "bf16", "int8", "int4", "int2", "sign", "topk", "powersgd"]
DEFAULT_BLOCK = 256  # elements per scale: the scales cost 4/256 bytes per element
DEFAULT_RATIO = 0.01  # topk: the share of elements sent
DEFAULT_POWERSGD_RANK = 4  # powersgd: the rank of each matrix's approximation
_F32 = 4
_QMAX = {"int8": 127, "int4": 7, "int2": 1}  # symmetric codes in [-qmax, qmax]
_BITS = {"int8": 8, "int4": 4, "int2": 2, "sign": 1}  # bits per element on the wire
# Elements encoded or decoded at a time: a chunk's temporaries (4 MiB of float32) come from the heap
# that runtime/heap.py keeps, where a whole-tensor temporary of a large model is a fresh mapping (its
# pages faulted in and cleared: ~0.15-0.2 s per 100 MB here). The blocks are independent, so the
# message is the same, bit for bit, whatever the chunk.
CHUNK = 1 << 20


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` zero-padded to whole blocks, as a (blocks, block) view."""
    n = x.numel()
    padded = torch.zeros(-(-n // block) * block, dtype=torch.float32, device=x.device)
    padded[:n] = x.reshape(-1)
    return padded.view(-1, block)


def quantize_symmetric(x: torch.Tensor, block: int, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes in [-qmax, qmax], scales): ``x ~ codes * scale`` per block, scale ``max|x| / qmax``;
    |error| <= scale / 2.

    >>> codes, scales = quantize_symmetric(torch.tensor([0.6, -1.0, 2.0, 0.4]), block=2, qmax=1)
    >>> codes.tolist(), scales.tolist()
    ([1, -1, 1, 0], [1.0, 2.0])
    """
    padded = _blocks(x, block)
    scales = padded.abs().amax(dim=1) / qmax
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return codes.view(-1)[: x.numel()], scales


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales): ``x ~ codes * scale`` per block of ``block`` elements; |error| <= scale / 2.

    >>> codes, scales = quantize_int8(torch.tensor([0.5, -1.0, 2.0]), block=2)
    >>> codes.tolist(), scales.tolist()
    ([64, -127, 127], [0.007874015718698502, 0.015748031437397003])
    """
    return quantize_symmetric(x, block, 127)


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values of ``codes`` with one scale per block."""
    n = codes.numel()
    return codes.to(torch.float32) * scales.repeat_interleave(block)[:n]


def _into(out: torch.Tensor, x: torch.Tensor, add: bool) -> None:
    if add:
        out.add_(x)
    else:
        out.copy_(x)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes below ``2**bits`` (``bits`` in 1, 2, 4), ``8 // bits`` to a byte, first in the low bits.

    >>> pack_bits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1]), 1).tolist()
    [13, 1]
    """
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes.reshape(-1)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The ``numel`` unsigned codes (uint8) of :func:`pack_bits`."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    return ((packed.reshape(-1, 1) >> shifts) & mask).view(-1)[:numel]


def topk_count(ratio: float, numel: int) -> int:
    """``k = ceil(ratio * numel)``, at least 1 and at most ``numel`` (a product within 1e-9 of an
    integer counts as that integer, so 0.01 * 1e6 is 10000)."""
    product = ratio * numel
    k = round(product) if abs(product - round(product)) < 1e-9 else math.ceil(product)
    return max(1, min(numel, k))


class Compressor:
    """Encodes one rank's flat float32 tensor for the wire, with error feedback, and decodes messages.

    ``encode(x, tail)`` sends ``x + e`` (``e`` the error left from the last message) and keeps the
    new error; ``tail`` (counts, flags) rides along in float32, exact. ``decode(msg)`` gives back
    ``(x_hat, tail)``. ``none`` sends float32 itself (no error). ``block`` is the elements per scale
    (int8, int4, int2, sign), ``ratio`` the share of elements topk sends.
    """

    def __init__(
        self,
        mode: Compression,
        numel: int,
        block: int = DEFAULT_BLOCK,
        error_feedback: bool = True,
        device: torch.device | None = None,
        ratio: float = DEFAULT_RATIO,
    ):
        assert 0 < ratio <= 1, "ratio in (0, 1]"
        assert mode != "powersgd", "powersgd is parambox.strategies.powersgd.PowerSGD, not a per-rank message"
        self.mode, self.numel, self.block, self.ratio = mode, numel, block, ratio
        self.num_blocks = -(-numel // block)
        self.k = topk_count(ratio, numel)
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
        if self.mode == "topk":
            return 2 * _F32 * self.k  # float32 values, int32 indices
        per_byte = 8 // _BITS[self.mode]
        return _F32 * self.num_blocks + -(-self.numel // per_byte)

    def message_bytes(self, tail: int) -> int:
        """Bytes of one message with a float32 tail of ``tail`` elements."""
        return self.payload_bytes() + _F32 * tail

    def encode(self, x: torch.Tensor, tail: torch.Tensor | None = None) -> torch.Tensor:
        """One message (``uint8``; for ``none`` the float32 concatenation, reduced as is)."""
        tail = torch.zeros(0, device=x.device) if tail is None else tail.reshape(-1).float()
        x = x.reshape(-1)
        if self.mode == "none":
            return torch.cat([x, tail])
        if self.mode == "topk":  # the k largest of the whole tensor: not chunked
            y = x + self.error if self.error is not None else x
            parts = self._codes(y)
            if self.error is not None:
                torch.sub(y, self._decode_parts(parts, self.numel), out=self.error)
            return torch.cat([tail.view(torch.uint8), *(p.reshape(-1).view(torch.uint8) for p in parts)])
        cut = _F32 * tail.numel()
        msg = torch.empty(cut + self.payload_bytes(), dtype=torch.uint8, device=x.device)
        msg[:cut].view(torch.float32).copy_(tail)
        whole = self._split(msg[cut:])
        for a, b in self._chunks():
            y = x[a:b] + self.error[a:b] if self.error is not None else x[a:b]
            parts = self._codes(y)
            for dst, src in zip(self._chunk_of(whole, a, b), parts):
                dst.copy_(src.reshape(-1).view(dst.dtype))
            if self.error is not None:
                torch.sub(y, self._decode_parts(parts, b - a), out=self.error[a:b])
        return msg

    def decode(self, msg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x_hat, tail)`` of a message from any rank (same mode, numel, block and ratio)."""
        if self.mode == "none":
            return msg[: self.numel], msg[self.numel :]
        out = torch.empty(self.numel, dtype=torch.float32, device=msg.device)
        return out, self.decode_into(msg, out)

    def tail_numel(self, msg: torch.Tensor) -> int:
        """Elements of the float32 tail that ``msg`` carries."""
        if self.mode == "none":
            return msg.numel() - self.numel
        return (msg.numel() - self.payload_bytes()) // _F32

    def decode_into(self, msg: torch.Tensor, out: torch.Tensor, add: bool = False) -> torch.Tensor:
        """The message's ``x_hat`` into ``out`` (added to it with ``add``), a chunk at a time; its tail."""
        if self.mode == "none":
            x, tail = msg[: self.numel], msg[self.numel :]
            _into(out, x, add)
            return tail
        cut = msg.numel() - self.payload_bytes()
        tail, whole = msg[:cut].view(torch.float32), self._split(msg[cut:])
        if self.mode == "topk":
            values, indices = whole
            if not add:
                out.zero_()
            out.index_put_((indices.long(),), values, accumulate=True)
            return tail
        for a, b in self._chunks():
            _into(out[a:b], self._decode_parts(self._chunk_of(whole, a, b), b - a), add)
        return tail

    def _chunks(self) -> list[tuple[int, int]]:
        """``[a, b)`` ranges of whole blocks and whole bytes of codes (the last one may end short)."""
        step = -(-CHUNK // math.lcm(self.block, 8)) * math.lcm(self.block, 8)
        return [(a, min(a + step, self.numel)) for a in range(0, self.numel, step)]

    def _chunk_of(self, parts: tuple[torch.Tensor, ...], a: int, b: int) -> tuple[torch.Tensor, ...]:
        """The slices of a message's parts (:meth:`_split`) that encode elements ``a`` to ``b``."""
        if self.mode == "bf16":
            return (parts[0][a:b],)
        scales, codes = parts
        per = 8 // _BITS[self.mode]  # elements a byte
        return scales[a // self.block : -(-b // self.block)], codes[a // per : -(-b // per)]

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What the receivers will decode of ``x`` (error feedback applied): for a box that stores float32."""
        return self.decode(self.encode(x))[0]

    def _codes(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.mode == "bf16":
            return (y.to(torch.bfloat16),)
        if self.mode == "topk":
            indices = torch.topk(y.abs(), self.k, sorted=False).indices
            return y[indices], indices.to(torch.int32)
        if self.mode == "sign":
            padded = _blocks(y, self.block)
            blocks = padded.shape[0]
            counts = torch.full((blocks,), float(self.block), device=y.device)
            counts[-1] = y.numel() - (blocks - 1) * self.block  # the last block's own elements
            scales = padded.abs().sum(dim=1) / counts
            return scales, pack_bits((y < 0).to(torch.uint8), 1)
        codes, scales = quantize_symmetric(y, self.block, _QMAX[self.mode])
        if self.mode == "int8":
            return scales, codes
        return scales, pack_bits((codes + _QMAX[self.mode]).to(torch.uint8), _BITS[self.mode])

    def _split(self, body: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of :meth:`_codes` from a message's body (its bytes after the tail)."""
        if self.mode == "bf16":
            return (body.view(torch.bfloat16),)
        head = _F32 * (self.k if self.mode == "topk" else self.num_blocks)
        first, rest = body[:head].view(torch.float32), body[head:]
        if self.mode == "topk":
            return first, rest.view(torch.int32)
        return first, rest.view(torch.int8) if self.mode == "int8" else rest

    def _decode_parts(self, parts: tuple[torch.Tensor, ...], n: int) -> torch.Tensor:
        """The ``n`` float32 values that ``parts`` (of :meth:`_codes`, or a chunk's) encode."""
        if self.mode == "bf16":
            return parts[0].float()
        if self.mode == "topk":
            values, indices = parts
            out = torch.zeros(n, dtype=torch.float32, device=values.device)
            return out.index_put_((indices.long(),), values)
        scales, codes = parts
        if self.mode == "sign":
            signs = 1.0 - 2.0 * unpack_bits(codes, 1, n).to(torch.float32)
            return dequantize_int8(signs, scales, self.block)
        if self.mode != "int8":
            qmax = _QMAX[self.mode]
            codes = unpack_bits(codes, _BITS[self.mode], n).to(torch.int8) - qmax
        return dequantize_int8(codes, scales, self.block)


# The encodings a box's server can decode (``ParameterBox.push_encoded_async``), by code: their order is
# the wire's.
WIRE_MODES: tuple[str, ...] = ("bf16", "int8", "int4", "int2", "sign", "topk")


class PushEncoder:
    """A worker's update encoded for the box with error feedback (``ParameterBox.push_encoded_async``):
    one :class:`Compressor` per range the box decodes apart (``code_pieces``: a shard each on the rma
    memory server, the whole update elsewhere), their errors views into one flat ``error``.

    >>> enc = PushEncoder("int8", [(0, 600), (600, 1000)], start=0)
    >>> [m.numel() for m in enc.encode(torch.ones(1000))], enc.error.shape
    ([612, 408], torch.Size([1000]))
    """

    def __init__(
        self,
        mode: Compression,
        pieces: list[tuple[int, int]],
        start: int,
        block: int = DEFAULT_BLOCK,
        ratio: float = DEFAULT_RATIO,
        device: torch.device | None = None,
    ):
        self.mode, self.code, self.params = mode, WIRE_MODES.index(mode), (float(block), float(ratio))
        self.ranges = [(lo - start, hi - start) for lo, hi in pieces]
        self.numel = self.ranges[-1][1]
        self.error = torch.zeros(self.numel, device=device)  # what the pushes still owe
        self.parts = []
        for lo, hi in self.ranges:
            part = Compressor(mode, hi - lo, block, device=device, ratio=ratio)
            part.error = self.error[lo:hi]
            self.parts.append(part)

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The messages of ``x + error``, one a range; ``error`` keeps what they leave out."""
        return [c.encode(x[lo:hi]) for c, (lo, hi) in zip(self.parts, self.ranges)]

    def decode(self, messages: list[torch.Tensor]) -> torch.Tensor:
        """What the box adds for these messages."""
        return torch.cat([c.decode(m)[0] for c, m in zip(self.parts, messages)])

    def message_bytes(self) -> int:
        """Bytes of one push's messages."""
        return sum(c.message_bytes(0) for c in self.parts)


def _decode_push(code: int, message: torch.Tensor, numel: int, params: tuple[float, ...]) -> torch.Tensor:
    block, ratio = params
    mode = WIRE_MODES[code]
    return Compressor(mode, numel, int(block), error_feedback=False, ratio=ratio).decode(message)[0]  # type: ignore[arg-type]


set_decoder(_decode_push)
