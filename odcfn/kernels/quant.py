"""Wire formats of gathers and pushes: block quantization, one fp32 scale per block.

A format turns ``n`` values into one flat ``uint8`` buffer and back:

    payload   n elements of the format's element type (1 byte for fp8 / int8, 2 for bf16, 4 for fp32)
    padding   up to a multiple of 4 bytes
    scales    ceil(n / block) fp32 scales (scaled formats only)

Blocks start at element 0 of the buffer, so every owner's shard is quantized on its own: a gather
decodes each owner's piece with that owner's scales and nothing crosses a shard boundary.

- ``int8``: scale ``s = absmax / 127`` per block, ``q = round_half_even(x / s)`` in [-127, 127];
  decoded ``q * s``. Per-element error at most ``s / 2 = absmax / 254``.
- ``fp8_e4m3`` (the OCP E4M3 "fn" format, torch's ``float8_e4m3fn``): ``s = absmax / 448`` (448:
  the largest finite E4M3), ``q = e4m3(x / s)`` rounded to nearest even; decoded ``q * s``. Per
  element error at most ``|x| * 2**-4`` (3 mantissa bits) or, below the smallest normal
  (``2**-6 * s``), ``2**-10 * s`` (half a subnormal step).
- ``bf16`` / ``fp32``: a plain cast (no scales).

A block whose values are all zero gets scale 1; a block holding NaN or inf gets a NaN scale, so
a non-finite gradient stays non-finite through a push (the step's ``nonfinite`` check sees it).
The E4M3 encoder is written in plain arithmetic (``_e4m3_bits``) and tested bit for bit against
torch's own ``float8_e4m3fn``; decoding views the bits as that dtype, so fp8 needs a torch that
has it (``check_format`` refuses otherwise, before any communication).

``Wire`` is what a step asks of a transport (the gather and push formats, error feedback);
``WireState`` is the transport's side: it holds the error-feedback residuals across pushes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "BLOCK",
    "GATHER_FORMATS",
    "PUSH_FORMATS",
    "Format",
    "Wire",
    "WireState",
    "check_format",
    "decode",
    "encode",
    "error_bound",
    "get_format",
    "publish",
    "resident",
    "roundtrip",
    "unpublish",
]

BLOCK = 128  # values per scale (ZeRO++'s and torchao's default granularity)
GATHER_FORMATS = ("bf16", "fp8_e4m3", "int8")
PUSH_FORMATS = ("fp32", "bf16", "int8")
E4M3_MAX = 448.0
INT8_MAX = 127.0
# dtypes that only ever hold a format's bytes, never a parameter's values
_BYTE_DTYPES = (torch.uint8, torch.int8, *((torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn") else ()))


@dataclass(frozen=True)
class Format:
    """One wire format: its name, element type, element size and whether it carries scales."""

    name: str
    itemsize: int
    scaled: bool
    block: int = BLOCK

    def nbytes(self, n: int) -> int:
        """The encoded size of ``n`` values, scales included: what a transfer moves."""
        if not self.scaled:
            return n * self.itemsize
        return _pad4(n * self.itemsize) + 4 * _blocks(n, self.block)

    @property
    def element_dtype(self) -> torch.dtype:
        return {
            "fp32": torch.float32,
            "bf16": torch.bfloat16,
            "int8": torch.int8,
            "fp8_e4m3": getattr(torch, "float8_e4m3fn", torch.uint8),
        }[self.name]


_ITEMSIZE = {"fp32": 4, "bf16": 2, "int8": 1, "fp8_e4m3": 1}


def check_format(value: object, key: str, allowed: tuple[str, ...]) -> None:
    """A ``ValueError`` naming ``key`` for an unknown format, or fp8 with a torch lacking it."""
    if value is None:
        return
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(
            f"{key} must be one of {list(allowed)} or None (the default: the compute dtype), got {value!r}"
        )
    if value == "fp8_e4m3" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(
            f"{key}='fp8_e4m3' needs torch.float8_e4m3fn, which torch {torch.__version__} lacks "
            "(use 'int8', or a torch >= 2.1)"
        )


def get_format(name: str, block: int = BLOCK) -> Format:
    if name not in _ITEMSIZE:
        raise ValueError(f"unknown wire format {name!r}: one of {sorted(_ITEMSIZE)}")
    return Format(name, _ITEMSIZE[name], name in ("int8", "fp8_e4m3"), block)


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def _scales(x: torch.Tensor, fmt: Format, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x padded to whole blocks, as (blocks, block) fp32; the per-block scales)``."""
    n, b = x.numel(), fmt.block
    xb = torch.zeros(_blocks(n, b) * b, dtype=torch.float32, device=x.device)
    xb[:n] = x.reshape(-1)
    xb = xb.view(-1, b)
    amax = xb.abs().amax(dim=1)
    # a NaN anywhere in a block: amax is NaN (torch's amax propagates NaN); inf: scale inf -> NaN
    s = amax / top
    s = torch.where(amax == 0, torch.ones_like(s), s)
    s = torch.where(torch.isfinite(s), s, torch.full_like(s, math.nan))
    return xb, s


def _e4m3_bits(y: torch.Tensor) -> torch.Tensor:
    """E4M3 (fn) bit patterns of ``y`` (fp32, finite, |y| <= 448), round to nearest even, as uint8.

    Exponent bias 7; normals have exponent fields 1..15 (1.mmm x 2**(e-7)), subnormals field 0
    (0.mmm x 2**-6). The quantum of ``|y|`` is ``2**(floor(log2 |y|) - 3)``, at least ``2**-9``:
    dividing by it is exact (a power of two), ``torch.round`` rounds half to even."""
    a = y.abs()
    _, e = torch.frexp(a)  # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1
    e = torch.clamp(e - 1, min=-6)
    quantum = torch.ldexp(torch.ones_like(a), e - 3)
    r = torch.clamp(torch.round(a / quantum) * quantum, max=E4M3_MAX)  # may carry into the next binade
    _, e2 = torch.frexp(r)
    normal = r >= 2.0**-6
    exp_field = torch.where(normal, e2 - 1 + 7, torch.zeros_like(e2))
    mant = torch.where(normal, r / torch.ldexp(torch.ones_like(r), e2 - 1) * 8 - 8, r * 2.0**9)
    bits = exp_field * 8 + mant.to(torch.int32)
    bits = bits | torch.where(torch.signbit(y), 0x80, 0).to(torch.int32)
    return bits.to(torch.uint8)


def encode(x: torch.Tensor, fmt: Format, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (any float dtype, flattened) in ``fmt`` as a ``uint8`` buffer of ``fmt.nbytes(n)``;
    written into ``out`` when given (a published segment, a push staging buffer)."""
    n = x.numel()
    if out is None:
        out = torch.empty(fmt.nbytes(n), dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or out.numel() != fmt.nbytes(n):
        raise ValueError(f"encode: out must be {fmt.nbytes(n)} uint8, got {out.numel()} {out.dtype}")
    pay = out[: n * fmt.itemsize]
    if not fmt.scaled:
        pay.view(fmt.element_dtype).copy_(x.reshape(-1))
        return out
    top = INT8_MAX if fmt.name == "int8" else E4M3_MAX
    xb, s = _scales(x, fmt, top)
    y = (xb / s[:, None]).reshape(-1)[:n]
    y = torch.nan_to_num(y, nan=0.0).clamp(-top, top)  # a NaN block decodes through its NaN scale
    if fmt.name == "int8":
        pay.view(torch.int8).copy_(torch.round(y).to(torch.int8))
    else:
        pay.copy_(_e4m3_bits(y))
    out[n : _pad4(n)].zero_()  # the padding too: equal inputs give equal bytes
    out[_pad4(n) :].view(torch.float32).copy_(s)
    return out


def decode(data: torch.Tensor, fmt: Format, out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (flat, any float dtype: the compute dtype) from ``data`` (``encode``'s bytes).
    Scaled values are decoded in fp32 (``q * s``, exact: ``q`` has at most 8 significant bits
    and ``s`` is fp32), then cast to ``out``'s dtype."""
    n = out.numel()
    if data.numel() != fmt.nbytes(n):
        raise ValueError(f"decode: {fmt.name} data of {data.numel()} bytes does not hold {n} values")
    pay = data[: n * fmt.itemsize].view(fmt.element_dtype)
    if not fmt.scaled:
        return out.copy_(pay)
    s = data[_pad4(n) :].view(torch.float32)
    nb, b = s.numel(), fmt.block
    q = torch.zeros(nb * b, dtype=torch.float32, device=data.device)
    q[:n] = pay.to(torch.float32)
    return out.copy_((q.view(nb, b) * s[:, None]).reshape(-1)[:n])


def roundtrip(x: torch.Tensor, fmt: Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``decode(encode(x))`` in ``dtype``: what a receiver gets for ``x``."""
    out = torch.empty(x.numel(), dtype=dtype, device=x.device)
    return decode(encode(x, fmt), fmt, out)


def error_bound(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """The largest error a round trip of each element of ``x`` may make in fp32 (the format's own
    rounding; a cast of the result to a narrower compute dtype adds that dtype's rounding)."""
    x = x.reshape(-1).to(torch.float32)
    if not fmt.scaled:
        ulp = {"fp32": 0.0, "bf16": 2.0**-8}[fmt.name]
        return x.abs() * ulp
    top = INT8_MAX if fmt.name == "int8" else E4M3_MAX
    _, s = _scales(x, fmt, top)
    s = s.repeat_interleave(fmt.block)[: x.numel()]
    slack = x.abs() * 2.0**-20  # x / s is rounded to fp32 before the format's own rounding
    if fmt.name == "int8":
        return s / 2 + slack
    return torch.maximum(x.abs() * 2.0**-4, s * 2.0**-10) + slack


@dataclass(frozen=True)
class Wire:
    """What a step asks of its transport: the format gathers move (None: the compute dtype, as
    before) and the one pushes move (None: the gradient's own dtype), ``feedback``: carry each
    push's rounding error into this rank's next push of the same unit (error feedback)."""

    gather: str | None = None
    push: str | None = None
    feedback: bool = False
    block: int = BLOCK

    @property
    def gather_format(self) -> Format | None:
        return None if self.gather is None else get_format(self.gather, self.block)

    @property
    def push_format(self) -> Format | None:
        return None if self.push is None else get_format(self.push, self.block)

    @property
    def active(self) -> bool:
        return self.gather is not None or self.push is not None


@dataclass
class WireState:
    """A transport's side of a ``Wire``: the residuals error feedback carries, one fp32 tensor
    per unit (the padded full gradient this rank pushes), kept across pushes and steps."""

    wire: Wire = field(default_factory=Wire)
    residual: dict[str, torch.Tensor] = field(default_factory=dict)
    key: tuple = ()  # the (push format, block) the residuals were made in

    def use(self, wire: Wire | None) -> WireState:
        """This state for the next step's ``wire`` (None: the default). The residuals survive
        passes that push nothing (a log-prob pass, ``gather_params``) and are dropped only when a
        push runs in another format or block size: they belong to it."""
        self.wire = wire or Wire()
        return self

    def push(self, unit: str, grad: torch.Tensor, pieces: int) -> tuple[torch.Tensor, list[int]]:
        """``(what the owners add, fp32 or grad itself; bytes moved per owner piece)`` for a push
        of ``grad`` (padded full flat) split into ``pieces`` equal owner slices, each quantized on
        its own (blocks start at each owner's slice)."""
        fmt = self.wire.push_format
        size = grad.numel() // pieces
        if fmt is None:
            return grad, [size * grad.element_size()] * pieces
        if self.key != (fmt.name, fmt.block):
            self.residual, self.key = {}, (fmt.name, fmt.block)
        g = grad.to(torch.float32)
        carry = self.residual.get(unit) if self.wire.feedback else None
        if carry is not None:
            g = g + carry
        sent = torch.empty_like(g)
        for i in range(pieces):
            piece = g[i * size : (i + 1) * size]
            decode(encode(piece, fmt), fmt, sent[i * size : (i + 1) * size])
        if self.wire.feedback:
            # a NaN block stays out of the residual: the step refuses or skips it, and its
            # error must not poison later pushes
            self.residual[unit] = torch.nan_to_num(g - sent, nan=0.0, posinf=0.0, neginf=0.0)
        return sent, [fmt.nbytes(size)] * pieces


def publish(
    buf: torch.Tensor | None, shard: torch.Tensor, dtype: torch.dtype, fmt: Format | None
) -> torch.Tensor:
    """An owner's published copy of ``shard``: in ``dtype`` (``fmt`` None, as before) or encoded
    in ``fmt`` (uint8); ``buf`` is reused when it already has that dtype and size. A shard held
    encoded already (``resident``'s form: a frozen unit kept in ``fmt``) is copied as its bytes,
    never encoded again."""
    if fmt is not None and shard.dtype == fmt.element_dtype:
        raw = shard.reshape(-1).view(torch.uint8)  # fmt's payload dtype: encode's bytes as they are
        if buf is None or buf.dtype != torch.uint8 or buf.numel() != raw.numel():
            buf = torch.empty(raw.numel(), dtype=torch.uint8, device=shard.device)
        return buf.copy_(raw)
    if shard.dtype in _BYTE_DTYPES:
        want_fmt = "its own format" if fmt is None else f"{fmt.name} (its element type {fmt.element_dtype})"
        raise ValueError(
            f"publish: a shard held encoded ({shard.dtype}) cannot be published as {want_fmt}: decode it "
            "first (odcfn.step.frozen_quant)"
        )
    n = shard.numel()
    want, numel = (dtype, n) if fmt is None else (torch.uint8, fmt.nbytes(n))
    if buf is None or buf.dtype != want or buf.numel() != numel:
        buf = torch.empty(numel, dtype=want, device=shard.device)
    if fmt is None:
        return buf.copy_(shard.reshape(-1))
    return encode(shard, fmt, buf)


def resident(shard: torch.Tensor, fmt: Format) -> torch.Tensor:
    """``shard`` kept in ``fmt`` for good (a frozen unit: it never changes, so it is encoded once):
    ``encode``'s bytes viewed as the format's element type (int8, float8_e4m3fn, bf16), so the
    dtype names the format and ``publish`` copies the bytes as they are. Its size is
    ``fmt.nbytes(n)`` bytes, scales included."""
    return encode(shard, fmt).view(fmt.element_dtype)


def unpublish(src: torch.Tensor, out: torch.Tensor, fmt: Format | None) -> torch.Tensor:
    """A gatherer's copy of an owner's published ``src`` into ``out`` (its compute-dtype slice)."""
    if fmt is None:
        if src.dtype == torch.uint8 and out.dtype != torch.uint8:  # the owner published a format
            raise ValueError(
                "a gather in the compute dtype found an encoded publication: ranks disagree on "
                "StepConfig.gather_format"
            )
        return out.copy_(src)
    if src.dtype != torch.uint8:
        raise ValueError(
            f"a {fmt.name} gather found a {src.dtype} publication: ranks disagree on StepConfig.gather_format"
        )
    return decode(src, fmt, out)
