"""The V4.1 storage formats (redknot.kernels.mx_formats) against hand-written bit patterns, plus
round trips with fresh random inputs. Expected bytes are written out by hand from the format
definitions (OCP e4m3fn, e2m1, E8M0), never produced by the code under test."""
import math

import pytest
import torch

from redknot.kernels import mx_formats as mx


def _u8(*vals):
    return torch.tensor(vals, dtype=torch.uint8)


# ------------------------------------------------------------------------------------------ E8M0
def test_e8m0_encode_powers_of_two_and_nan():
    s = torch.tensor([1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127, 2.0 ** -126, float("nan")])
    assert mx.e8m0_encode(s).tolist() == [127, 128, 126, 0, 254, 1, 255]


def test_e8m0_encode_rounds_non_powers_up():
    s = torch.tensor([3.0, 1.0000001, 0.75, 2.0 ** -127 * 1.5])
    assert mx.e8m0_encode(s).tolist() == [129, 128, 127, 1]


def test_e8m0_decode():
    out = mx.e8m0_decode(_u8(127, 128, 126, 0, 254, 255))
    assert out[:5].tolist() == [1.0, 2.0, 0.5, 2.0 ** -127, 2.0 ** 127]
    assert math.isnan(out[5].item())


def test_e8m0_decode_accepts_float8_e8m0_view():
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("torch without float8_e8m0fnu")
    assert mx.e8m0_decode(_u8(130).view(torch.float8_e8m0fnu)).item() == 8.0


def test_scale_choice_is_ceil_log2_of_amax_over_fmax():
    amax = torch.tensor([448.0, 449.0, 224.0, 224.5, 0.0, 6.0, 6.5])
    fp8 = mx.pow2_scale_e8m0(amax[:5], 448.0, mx.FP8_ACT_AMAX_FLOOR).tolist()
    # 1e-4 / 448 = 2.23e-7 -> log2 = -22.1 -> ceil -22 -> byte 105
    assert fp8 == [127, 128, 126, 127, 105]
    assert mx.pow2_scale_e8m0(amax[5:], 6.0, mx.FP4_E8M0_AMAX_FLOOR).tolist() == [127, 128]


# --------------------------------------------------------------------------------- element codecs
def test_fp8_bit_patterns():
    v = torch.tensor([1.0, 448.0, -2.0, 0.5, 1000.0, -1000.0, 1.1875, 2.0 ** -9])
    # e4m3fn: sign | eeee | mmm, bias 7; 1.1875 ties between 1.125 (0x39) and 1.25 (0x3A): even -> 0x3A
    assert mx.fp8_encode(v).view(torch.uint8).tolist() == [0x38, 0x7E, 0xC0, 0x30, 0x7E, 0xFE, 0x3A, 0x01]


def test_e2m1_codes_and_ties_to_even():
    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, -0.5, 7.0])
    assert mx.e2m1_encode(v).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 15, 9, 7]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    assert mx.e2m1_encode(ties).tolist() == [0, 2, 2, 4, 4, 6, 6, 0, 14]  # -0.25 -> +0, never -0
    assert mx.e2m1_decode(_u8(0, 7, 9, 15)).tolist() == [0.0, 6.0, -0.5, -6.0]


def test_nibble_packing_low_nibble_is_even_element():
    codes = _u8(0, 1, 2, 3, 4, 5, 6, 7, 15, 8)
    packed = mx.pack_nibbles(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x8F]
    assert mx.unpack_nibbles(packed).tolist() == codes.tolist()


# ------------------------------------------------------------------------------------- group quant
def test_fp8_group_of_32_by_hand():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 1.0, -2.0        # group 0: amax 448 -> scale 2^0 (byte 127)
    x[0, 32], x[0, 33] = 3.0, 1.0                      # group 1: 3/448 -> ceil log2 = -7 -> byte 120
    q, s = mx.quant_fp8_groups(x)
    assert s.tolist() == [[127, 120]]
    qb = q.view(torch.uint8)[0]
    assert qb[:3].tolist() == [0x7E, 0x38, 0xC0]
    # 3 / 2^-7 = 384 = 1.5 * 2^8 -> exp 15 (0b1111), mantissa 0b100 -> 0x7C; 1 / 2^-7 = 128 = 2^7 -> 0x70
    assert qb[32:34].tolist() == [0x7C, 0x70]
    assert torch.equal(mx.dequant_fp8_groups(q, s), x)


def test_fp4_e8m0_group_by_hand():
    x = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] + [0.0] * 24])  # amax 6 -> scale 1
    p, s = mx.quant_fp4_groups(x, 32, "ue8m0")
    assert s.tolist() == [[127]]
    assert p[0, :4].tolist() == [0x10, 0x32, 0x54, 0x76]
    assert torch.equal(mx.dequant_fp4_groups(p, s, 32, "ue8m0"), x)


def test_fp4_e4m3_scale_group_by_hand():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 7.0, -1.0
    p, s = mx.quant_fp4_groups(x, 16, "e4m3")
    # 7/6 = 1.1667 -> e4m3 nearest 1.125 (0x39); 7/1.125 = 6.2 -> clamp 6 (code 7); -1/1.125 = -0.89 -> -1 (0xA)
    assert s.tolist() == [[0x39]]
    assert p[0, 0].item() == 0x7 | (0xA << 4)
    assert mx.dequant_fp4_groups(p, s, 16, "e4m3")[0, :2].tolist() == [6.75, -1.125]


def test_fp4_e4m3_scale_floor_is_smallest_subnormal():
    p, s = mx.quant_fp4_groups(torch.zeros(2, 16), 16, "e4m3")
    assert s.tolist() == [[0x01], [0x01]] and p.eq(0).all()


@pytest.mark.parametrize("fmt,scale_fmt,group,bound", [("fp8", "ue8m0", 32, 2 ** -4), ("fp4", "ue8m0", 32, 1 / 3),
                                                      ("fp4", "e4m3", 16, 0.25)])
def test_act_quant_error_bound_and_idempotent(fmt, scale_fmt, group, bound):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(16, 256, generator=g) * torch.logspace(-3, 2, 256)).to(torch.bfloat16)
    y = mx.act_quant_ref(x, fmt, group, scale_fmt)
    assert y.dtype == torch.bfloat16
    # error per element is at most half a step of the group's grid: relative to the group amax
    amax = x.float().unflatten(-1, (-1, group)).abs().amax(-1, keepdim=True)
    err = (y.float() - x.float()).unflatten(-1, (-1, group)).abs()
    assert (err <= bound * amax + 1e-30).all()
    assert torch.equal(mx.act_quant_ref(y, fmt, group, scale_fmt), y)  # the grid is a fixed point


def test_act_quant_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fmt='int8'"):
        mx.act_quant_ref(torch.zeros(32), "int8")
    with pytest.raises(ValueError, match="multiple of group=32"):
        mx.act_quant_ref(torch.zeros(40), "fp8")
    with pytest.raises(ValueError, match="scale_fmt='e5m2'"):
        mx.act_quant_ref(torch.zeros(32), "fp4", 32, "e5m2")


# -------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_blocks_scale_per_tile(block):
    w = torch.zeros(2 * block, 2 * block + 5)  # ragged last column tile
    w[0, 0] = 448.0           # tile (0,0): byte 127
    w[block, 1] = 0.875       # tile (1,0): 0.875/448 -> 2^-9 -> byte 118
    w[1, 2 * block + 4] = -2  # tile (0,2): 2/448 -> 2^-7.8 -> byte 120
    q, s = mx.quant_fp8_blocks(w, block)
    assert s.shape == (2, 3) and q.shape == w.shape
    assert s[0, 0] == 127 and s[1, 0] == 118 and s[0, 2] == 120
    assert s[1, 1] == 1  # empty tile: smallest scale 2^-126
    assert torch.equal(mx.dequant_fp8_blocks(q, s, block), w)


def test_fp8_blocks_v4_pitfall_32_vs_128():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 128, generator=g) * torch.logspace(-2, 1, 128)[:, None]
    q, s = mx.quant_fp8_blocks(w, 32)
    right = mx.dequant_fp8_blocks(q, s, 32)
    assert (right - w).norm() / w.norm() < 0.05
    wrong = (q.float() * mx.e8m0_decode(s)[0, 0])  # one scale for the whole 128x128 tile: corrupt
    assert (wrong - w).norm() / w.norm() > 0.5


def test_mxfp4_weight_by_hand_and_roundtrip():
    w = torch.zeros(2, 64)
    w[0, :8] = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0])  # amax 12 -> scale 2 (byte 128)
    w[1, 33] = -0.75                                                    # 0.75/6 -> 2^-3 -> byte 124
    p, s = mx.quant_mxfp4(w)
    assert p.dtype == torch.uint8 and p.shape == (2, 32) and s.shape == (2, 2)
    assert s.tolist() == [[128, 1], [1, 124]]
    assert p[0, :4].tolist() == [0x10, 0x32, 0x54, 0x76]  # values / 2 are the e2m1 grid, codes 0..7
    assert torch.equal(mx.dequant_mxfp4(p, s), w)
    assert p[1, 16].item() == 0xF0  # element 33 (odd): high nibble, -6 after scale 2^-3 -> code 15


# ------------------------------------------------------------------------------------------ cache rows
def test_row_sizes_match_the_document():
    assert (mx.WINDOW_ROW_BYTES, mx.COMPRESSED_ENTRY_BYTES, mx.INDEX_KEY_BYTES) == (528, 288, 68)
    assert mx.pack_window_rows(torch.zeros(3, 512)).shape == (3, 528)
    assert mx.pack_compressed_entries(torch.zeros(3, 512)).shape == (3, 288)
    assert mx.pack_index_keys(torch.zeros(3, 128)).shape == (3, 68)


def test_window_row_layout_by_hand():
    x = torch.zeros(512)
    x[0], x[31], x[32], x[511] = 448.0, -1.0, 0.5, 3.0
    row = mx.pack_window_rows(x)
    assert row[0].item() == 0x7E and row[31].item() == 0xB8
    # group 1: 0.5/448 -> ceil log2 = -9 -> byte 118; 0.5 / 2^-9 = 256 = 2^8 -> 0x78
    assert row[32].item() == 0x78
    # group 15: 3/448 -> 2^-7 (byte 120); 3 / 2^-7 = 384 -> 0x7C
    assert row[511].item() == 0x7C
    assert row[mx.WINDOW_SCALE_OFFSET:].tolist() == [127, 118] + [105] * 13 + [120]  # empty: 1e-4 floor
    assert torch.equal(mx.unpack_window_rows(row), x)


def test_compressed_entry_layout_by_hand():
    x = torch.zeros(512)
    x[0], x[1], x[16] = 6.0, -3.0, 0.5
    row = mx.pack_compressed_entries(x)
    assert row[0].item() == 0x7 | (0xD << 4)      # 6 -> code 7 (low), -3 -> code 13 (high)
    # group 1: 0.5/6 = 0.0833 -> e4m3 1.375*2^-4 (0x1B); 0.5 / 0.0859375 = 5.82 -> 6 (code 7)
    assert row[8].item() == 0x07
    assert row[mx.COMPRESSED_SCALE_OFFSET:mx.COMPRESSED_SCALE_OFFSET + 3].tolist() == [0x38, 0x1B, 0x01]
    out = mx.unpack_compressed_entries(row)
    assert out[:2].tolist() == [6.0, -3.0] and out[16].item() == 6 * 0.0859375


def test_index_key_layout_by_hand():
    x = torch.zeros(128)
    x[0], x[1], x[127] = 1.5, 6.0, -24.0
    row = mx.pack_index_keys(x)
    assert row[0].item() == 0x3 | (0x7 << 4)
    assert row[63].item() == 0xF0                 # element 127: high nibble, -24/4 = -6 -> code 15
    assert row[mx.INDEX_KEY_SCALE_OFFSET:].tolist() == [127, 1, 1, 129]
    assert torch.equal(mx.unpack_index_keys(row), x)


@pytest.mark.parametrize("pack,unpack,d,fmt,group,scale_fmt", [
    (mx.pack_window_rows, mx.unpack_window_rows, 512, "fp8", 32, "ue8m0"),
    (mx.pack_compressed_entries, mx.unpack_compressed_entries, 512, "fp4", 16, "e4m3"),
    (mx.pack_index_keys, mx.unpack_index_keys, 128, "fp4", 32, "ue8m0"),
    (mx.pack_window_rows, mx.unpack_window_rows, 64, "fp8", 32, "ue8m0"),
])
def test_rows_roundtrip_equals_qdq(pack, unpack, d, fmt, group, scale_fmt):
    g = torch.Generator().manual_seed(d)
    x = (torch.randn(5, 7, d, generator=g) * 3).to(torch.bfloat16)
    rows = pack(x)
    assert rows.dtype == torch.uint8 and rows.shape[:2] == (5, 7)
    out = unpack(rows, torch.bfloat16)
    assert torch.equal(out, mx.act_quant_ref(x, fmt, group, scale_fmt))
    assert torch.equal(unpack(pack(out), torch.bfloat16), out)  # dequantised rows are on the grid


def test_unpack_rejects_wrong_row_size():
    with pytest.raises(ValueError, match="row of 100 bytes"):
        mx.unpack_window_rows(torch.zeros(2, 100, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        mx.unpack_index_keys(torch.zeros(2, 68))
