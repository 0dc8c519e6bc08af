"""DeepSeek-V4.1 storage formats in plain PyTorch: E8M0 scales, FP8/MXFP4 weights, per-32 activation
QDQ, and the three byte-row cache formats. Every fast kernel and the model's reference path use
these definitions; the byte layouts below are a contract (the paged caches store exactly these rows).

API
===
Scales
  e8m0_encode(scale) -> uint8          power-of-two float scale -> exponent byte (bias 127, 255 = NaN);
                                       a non-power of two is rounded *up* to the next power of two
  e8m0_decode(byte)  -> float32        2^(byte-127); 255 -> NaN
  pow2_scale_e8m0(amax, fmax, floor)   the scale choice rule (below) -> E8M0 byte
Element codecs
  fp8_encode(v) / fp8_decode(q)        e4m3fn round-to-nearest-even, saturating at ±448
  e2m1_encode(v) / e2m1_decode(c)      4-bit e2m1 codes (bit 3 sign; bits 0-2 index {0,.5,1,1.5,2,3,4,6}),
                                       round to nearest, ties to the even code; never a negative zero
  pack_nibbles(c) / unpack_nibbles(b)  two codes per byte, element 2i in the LOW nibble
Group quantisation along the last dim (activations, cache rows, Engram table rows)
  quant_fp8_groups(x, group=32)           -> (e4m3 [..., K], uint8 E8M0 [..., K/group])
  dequant_fp8_groups(q, s, group=32)      -> float
  quant_fp4_groups(x, group=32, scale_fmt="ue8m0"|"e4m3") -> (uint8 packed [..., K/2], uint8 scales [..., K/group])
  dequant_fp4_groups(p, s, group, scale_fmt)
  act_quant_ref(x, fmt="fp8"|"fp4", group=32, scale_fmt="ue8m0") -> x.dtype   (quantise-dequantise, "QDQ")
Weights
  quant_fp8_blocks(w, block=32) -> (e4m3 [N, K], uint8 E8M0 [ceil(N/b), ceil(K/b)])   V4.1: 32, V4: 128
  dequant_fp8_blocks(q, s, block=32, dtype)
  quant_mxfp4(w) -> (uint8 packed [N, K/2], uint8 E8M0 [N, K/32]);  dequant_mxfp4(p, s, dtype)
Cache rows (uint8 rows; the head dim D is a multiple of 32; real V4.1: D = 512 latent, 128 index key)
  pack_window_rows(x [..., D]) -> [..., D + D/32]            unpack_window_rows(rows, dtype)
  pack_compressed_entries(x [..., D]) -> [..., D/2 + D/16]   unpack_compressed_entries(rows, dtype)
  pack_index_keys(x [..., D]) -> [..., D/2 + D/32]           unpack_index_keys(rows, dtype)

Scale choice (deepseek_v41.md §3.0, the reference ``act_quant`` / ``fp4_act_quant``)
===================================================================================
* E8M0 scales: ``s = 2^ceil(log2(amax / fmax))`` where ``amax = max(|x|)`` over the group, clamped below
  at ``floor``. ``log2`` is not evaluated: the fp32 ratio ``amax / fmax`` is split into exponent bits,
  and the exponent is raised by one when any mantissa bit is set (exactly the reference's rule, so a
  ratio that is already a power of two keeps it). ``fmax`` = 448 (e4m3) or 6 (e2m1). Floors:
  FP8 activations 1e-4 (§3.0), FP4 with E8M0 ``6·2^-126`` (§3.0); weight tiles use ``fmax·2^-126``, so
  the smallest scale is ``2^-126``.
* E4M3 scales (compressed KV, groups of 16): ``s = e4m3_RNE_sat(amax / 6)``, amax clamped below at
  ``6·2^-9`` (the smallest e4m3 subnormal as scale), §3.0.
* Values: ``q = e4m3_RNE(clamp(x / s, ±448))`` or ``e2m1_RNE(clamp(x / s, ±6))``, computed in fp32.
  A dequantised value ``q·s`` is exact in bf16 (e4m3 and e2m1·e4m3 products have ≤ 5 significant bits).

Byte layouts of the cache rows (§4.8, §5.1; the document fixes the sizes, the order within a row is
chosen here and named by the ``*_OFFSET`` constants): values first, scales after, both in element order.
* Window row, 528 B for D = 512: bytes [0, D) e4m3 of element d; bytes [D, D + D/32) E8M0 of group g
  (elements 32g..32g+31). RoPE dims are quantised with the rest (V4.1 has no bf16 RoPE tail).
* Compressed entry, 288 B for D = 512: bytes [0, D/2) packed e2m1 (byte i: element 2i low nibble, 2i+1
  high nibble); bytes [D/2, D/2 + D/16) e4m3 scale of group g (elements 16g..16g+15).
* Index key, 68 B for D = 128: bytes [0, D/2) packed e2m1 as above; bytes [D/2, D/2 + D/32) E8M0 of
  group g (elements 32g..32g+31).
"""
from __future__ import annotations

from typing import Tuple

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_BIAS = 127
E8M0_NAN = 255
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of the 3-bit code
# Round-to-nearest-even boundaries of the e2m1 grid: magnitude m gets code = #boundaries passed, where
# a boundary whose upper neighbour has an even code is passed at equality (ties go to the even code).
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_UP = (False, True, False, True, False, True, False)

FP8_ACT_AMAX_FLOOR = 1e-4                 # §3.0 act_quant
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0 ** -126   # §3.0 fp4_act_quant, E8M0 variant
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0 ** -9     # §3.0 fp4_act_quant, E4M3 variant

MX_GROUP = 32               # activation / MXFP4 / window / index-key group along the last dim
COMPRESSED_GROUP = 16       # compressed-KV FP4 group (E4M3 scales)
V41_WEIGHT_BLOCK = 32       # dense FP8 weight tile of V4.1 (V4: 128)
V4_WEIGHT_BLOCK = 128

LATENT_DIM = 512            # window rows and compressed entries
INDEX_KEY_DIM = 128         # index keys
WINDOW_ROW_BYTES = LATENT_DIM + LATENT_DIM // MX_GROUP                          # 528
WINDOW_SCALE_OFFSET = LATENT_DIM                                                # 512
COMPRESSED_ENTRY_BYTES = LATENT_DIM // 2 + LATENT_DIM // COMPRESSED_GROUP       # 288
COMPRESSED_SCALE_OFFSET = LATENT_DIM // 2                                       # 256
INDEX_KEY_BYTES = INDEX_KEY_DIM // 2 + INDEX_KEY_DIM // MX_GROUP                # 68
INDEX_KEY_SCALE_OFFSET = INDEX_KEY_DIM // 2                                     # 64


# ----------------------------------------------------------------------------------------- scales
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def _as_bytes(s: torch.Tensor) -> torch.Tensor:
    """uint8 view of E8M0 / e4m3 scale bytes given as uint8, int8, float8_e8m0fnu or float8_e4m3fn."""
    if s.dtype == torch.uint8:
        return s
    if s.dtype in (torch.int8, torch.float8_e4m3fn) or s.dtype == getattr(torch, "float8_e8m0fnu", None):
        return s.view(torch.uint8)
    raise TypeError(f"scale bytes must be uint8/int8/float8, got {s.dtype}")


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Positive float scales -> E8M0 bytes ``ceil(log2(s)) + 127`` clamped to [0, 254]; NaN -> 255.

    Exact for powers of two in [2^-127, 2^127]; others round up (the scale choice rule of §3.0)."""
    b = _bits(scale)
    exp = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    e = torch.where(exp == 0, torch.where(mant > 0x400000, -126, -127),  # fp32 subnormals: 2^-127 or up
                    exp - 127 + (mant != 0).to(torch.int32))
    out = (e + E8M0_BIAS).clamp(0, 254)
    return torch.where(torch.isnan(scale.float()), E8M0_NAN, out).to(torch.uint8)


def e8m0_decode(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 ``2^(byte - 127)``; 255 -> NaN."""
    b = _as_bytes(byte).to(torch.int32)
    v = torch.exp2((b - E8M0_BIAS).float())
    return torch.where(b == E8M0_NAN, torch.full_like(v, float("nan")), v)


def pow2_scale_e8m0(amax: torch.Tensor, fmax: float, floor: float) -> torch.Tensor:
    """E8M0 byte of ``2^ceil(log2(max(amax, floor) / fmax))`` via exponent bits + mantissa round-up."""
    ratio = amax.float().clamp_min(floor) / fmax  # fp32 division, as the reference
    return e8m0_encode(ratio)


# -------------------------------------------------------------------------------- element codecs
def fp8_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn, round to nearest even, saturating at ±448."""
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_decode(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).float() if q.dtype == torch.uint8 else q.float()


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (clamped to ±6) -> uint8 codes 0..15, nearest e2m1, ties to the even code."""
    v = v.float().clamp(-E2M1_MAX, E2M1_MAX)
    m = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for bound, tie_up in zip(E2M1_BOUNDS, E2M1_TIE_UP):
        code += (m >= bound if tie_up else m > bound).to(torch.uint8)
    return code | (((v < 0) & (code != 0)).to(torch.uint8) << 3)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> fp32 values, by arithmetic on the bits (no host-made table: CUDA-graph safe)."""
    c = code.to(torch.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).to(torch.float32)) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def pack_nibbles(code: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2i in the low nibble, 2i+1 in the high nibble."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    b = _as_bytes(packed) if packed.dtype != torch.uint8 else packed
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------- group quantisation
def _groups(x: torch.Tensor, group: int, what: str) -> torch.Tensor:
    k = x.shape[-1]
    if k % group:
        raise ValueError(f"{what}: last dim {k} must be a multiple of group={group}")
    return x.float().unflatten(-1, (k // group, group))


def quant_fp8_groups(x: torch.Tensor, group: int = MX_GROUP, floor: float = FP8_ACT_AMAX_FLOOR
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 [..., K], E8M0 bytes [..., K/group]), one power-of-two scale per group."""
    g = _groups(x, group, "quant_fp8_groups")
    sbyte = pow2_scale_e8m0(g.abs().amax(-1), E4M3_MAX, floor)
    q = fp8_encode(g / e8m0_decode(sbyte)[..., None]).flatten(-2)
    return q, sbyte


def dequant_fp8_groups(q: torch.Tensor, s: torch.Tensor, group: int = MX_GROUP,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = _groups(fp8_decode(q), group, "dequant_fp8_groups")
    return (v * e8m0_decode(s)[..., None]).flatten(-2).to(dtype)


def _fp4_scale(amax: torch.Tensor, scale_fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scale bytes, float scale) for E2M1 groups: E8M0 power of two, or an e4m3 (RNE, saturated) value."""
    if scale_fmt == "ue8m0":
        sbyte = pow2_scale_e8m0(amax, E2M1_MAX, FP4_E8M0_AMAX_FLOOR)
        return sbyte, e8m0_decode(sbyte)
    if scale_fmt == "e4m3":
        s8 = fp8_encode(amax.float().clamp_min(FP4_E4M3_AMAX_FLOOR) / E2M1_MAX)
        return s8.view(torch.uint8), s8.float()
    raise ValueError(f"scale_fmt={scale_fmt!r}: must be 'ue8m0' or 'e4m3'")


def _fp4_scale_decode(s: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "ue8m0":
        return e8m0_decode(s)
    if scale_fmt == "e4m3":
        return _as_bytes(s).view(torch.float8_e4m3fn).float()
    raise ValueError(f"scale_fmt={scale_fmt!r}: must be 'ue8m0' or 'e4m3'")


def quant_fp4_groups(x: torch.Tensor, group: int = MX_GROUP, scale_fmt: str = "ue8m0"
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed e2m1 uint8 [..., K/2], scale bytes [..., K/group])."""
    g = _groups(x, group, "quant_fp4_groups")
    sbyte, s = _fp4_scale(g.abs().amax(-1), scale_fmt)
    code = e2m1_encode(g / s[..., None]).flatten(-2)
    return pack_nibbles(code), sbyte


def dequant_fp4_groups(packed: torch.Tensor, s: torch.Tensor, group: int = MX_GROUP, scale_fmt: str = "ue8m0",
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = _groups(e2m1_decode(unpack_nibbles(packed)), group, "dequant_fp4_groups")
    return (v * _fp4_scale_decode(s, scale_fmt)[..., None]).flatten(-2).to(dtype)


def act_quant_ref(x: torch.Tensor, fmt: str = "fp8", group: int = MX_GROUP, scale_fmt: str = "ue8m0"
                  ) -> torch.Tensor:
    """Quantise-dequantise ``x`` per ``group`` along the last dim, as the reference does before every
    FP8/FP4 linear (fp8) and on indexer queries / cache rows (fp4); returns x.dtype."""
    if fmt == "fp8":
        if scale_fmt != "ue8m0":
            raise ValueError(f"scale_fmt={scale_fmt!r}: fp8 activations use 'ue8m0' scales")
        return dequant_fp8_groups(*quant_fp8_groups(x, group), group=group, dtype=x.dtype)
    if fmt == "fp4":
        return dequant_fp4_groups(*quant_fp4_groups(x, group, scale_fmt), group=group, scale_fmt=scale_fmt,
                                  dtype=x.dtype)
    raise ValueError(f"fmt={fmt!r}: must be 'fp8' or 'fp4'")


# ------------------------------------------------------------------------------------------ weights
def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D weight [N, K], got shape {tuple(w.shape)}")


def quant_fp8_blocks(w: torch.Tensor, block: int = V41_WEIGHT_BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (e4m3 [N, K], E8M0 bytes [ceil(N/b), ceil(K/b)]), one scale per b×b tile
    (V4.1: b = 32, V4: b = 128); ragged edge tiles are padded with zeros for the amax."""
    _check_2d(w, "quant_fp8_blocks")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    pad = torch.zeros(nb * block, kb * block, dtype=torch.float32, device=w.device)
    pad[:n, :k] = w.float()
    tiles = pad.view(nb, block, kb, block)
    sbyte = pow2_scale_e8m0(tiles.abs().amax(dim=(1, 3)), E4M3_MAX, E4M3_MAX * 2.0 ** -126)
    q = fp8_encode(tiles / e8m0_decode(sbyte)[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), sbyte


def dequant_fp8_blocks(q: torch.Tensor, s: torch.Tensor, block: int = V41_WEIGHT_BLOCK,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _check_2d(q, "dequant_fp8_blocks")
    n, k = q.shape
    sf = e8m0_decode(s).repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (fp8_decode(q) * sf).to(dtype)


def quant_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float (K % 32 == 0) -> (packed uint8 [N, K/2], E8M0 bytes [N, K/32])."""
    _check_2d(w, "quant_mxfp4")
    return quant_fp4_groups(w, MX_GROUP, "ue8m0")


def dequant_mxfp4(packed: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequant_fp4_groups(packed, s, MX_GROUP, "ue8m0", dtype)


# ---------------------------------------------------------------------------------------- cache rows
def window_row_bytes(d: int = LATENT_DIM) -> int:
    return d + d // MX_GROUP


def compressed_entry_bytes(d: int = LATENT_DIM) -> int:
    return d // 2 + d // COMPRESSED_GROUP


def index_key_bytes(d: int = INDEX_KEY_DIM) -> int:
    return d // 2 + d // MX_GROUP


def _check_row(rows: torch.Tensor, per_row, what: str) -> int:
    """Head dim D of uint8 rows [..., B] with B = per_row(D); raises naming the sizes allowed."""
    if rows.dtype != torch.uint8:
        raise TypeError(f"{what}: rows must be uint8, got {rows.dtype}")
    nbytes = rows.shape[-1]
    for d in range(32, 8 * nbytes + 1, 32):
        if per_row(d) == nbytes:
            return d
    raise ValueError(f"{what}: a row of {nbytes} bytes matches no head dim (multiple of 32); "
                     f"D=512 gives {per_row(512)} B, D=128 gives {per_row(128)} B")


def pack_window_rows(x: torch.Tensor) -> torch.Tensor:
    """Window KV rows [..., D] -> uint8 [..., D + D/32]: e4m3 values, then E8M0 per 32."""
    q, s = quant_fp8_groups(x, MX_GROUP)
    return torch.cat([q.view(torch.uint8), s], dim=-1)


def unpack_window_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    d = _check_row(rows, window_row_bytes, "unpack_window_rows")
    return dequant_fp8_groups(rows[..., :d], rows[..., d:], MX_GROUP, dtype)


def pack_compressed_entries(x: torch.Tensor) -> torch.Tensor:
    """Compressed KV entries [..., D] -> uint8 [..., D/2 + D/16]: packed e2m1, then e4m3 per 16."""
    p, s = quant_fp4_groups(x, COMPRESSED_GROUP, "e4m3")
    return torch.cat([p, s], dim=-1)


def unpack_compressed_entries(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    d = _check_row(rows, compressed_entry_bytes, "unpack_compressed_entries")
    return dequant_fp4_groups(rows[..., :d // 2], rows[..., d // 2:], COMPRESSED_GROUP, "e4m3", dtype)


def pack_index_keys(x: torch.Tensor) -> torch.Tensor:
    """Index keys [..., D] -> uint8 [..., D/2 + D/32]: packed e2m1, then E8M0 per 32."""
    p, s = quant_fp4_groups(x, MX_GROUP, "ue8m0")
    return torch.cat([p, s], dim=-1)


def unpack_index_keys(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    d = _check_row(rows, index_key_bytes, "unpack_index_keys")
    return dequant_fp4_groups(rows[..., :d // 2], rows[..., d // 2:], MX_GROUP, "ue8m0", dtype)
