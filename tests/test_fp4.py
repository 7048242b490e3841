import pytest
import torch

from dsv4_mtp_hf import fp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_all_16_codes_decode_to_the_e2m1_table():
    codes = torch.arange(16, dtype=torch.uint8)
    expected = torch.tensor(E2M1 + [-v for v in E2M1])
    assert torch.equal(fp4.decode_e2m1(codes), expected)


def test_pack_puts_even_elements_in_the_low_nibble_and_round_trips():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(fp4.unpack_fp4(packed), codes)
    assert torch.equal(fp4.unpack_fp4(packed.view(torch.int8)), codes)  # checkpoints store I8


def test_encode_is_exact_on_representable_values_and_rounds_ties_to_even():
    values = fp4.decode_e2m1(torch.arange(16, dtype=torch.uint8))
    assert torch.equal(fp4.decode_e2m1(fp4.encode_e2m1(values)), values)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -9.0])
    assert fp4.decode_e2m1(fp4.encode_e2m1(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -6.0]


def test_e8m0_scales_match_the_definition_at_the_edges():
    raw = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    s = fp4.decode_scales(raw, "mxfp4")
    assert s[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(s[6])
    assert torch.equal(fp4.decode_scales(raw.view(torch.float8_e8m0fnu), "mxfp4")[:6], s[:6])


def test_e4m3_scales_match_the_definition_at_the_edges():
    raw = torch.tensor([0x00, 0x01, 0x08, 0x38, 0x7E, 0xB8], dtype=torch.uint8)  # 0, min subnormal, min normal, 1, 448, -1
    s = fp4.decode_scales(raw, "nvfp4")
    assert s.tolist() == [0.0, 2.0**-9, 2.0**-6, 1.0, 448.0, -1.0]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_dequantize_matches_the_format_definition_bit_for_bit(fmt):
    f = fp4.get_format(fmt)
    n, k = 6, 4 * f.group_size
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    if fmt == "nvfp4":
        scale = torch.randint(0, 0x7F, (n, k // f.group_size), dtype=torch.uint8)
        glob = torch.tensor(0.37)
        sf = scale.view(torch.float8_e4m3fn).float()
    else:
        scale = torch.randint(100, 150, (n, k // f.group_size), dtype=torch.uint8)
        glob = None
        sf = 2.0 ** (scale.float() - 127)
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    expected = table[codes.long()] * sf.repeat_interleave(f.group_size, dim=1)  # e2m1 * block scale
    if glob is not None:
        expected = expected * glob  # ... * global scale
    got = fp4.dequantize_fp4(fp4.pack_fp4(codes), scale, fmt, glob)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_quantize_round_trip_error_is_small_and_requantising_is_exact(fmt):
    w = torch.randn(3, 16, 128)
    packed, scale, glob = fp4.quantize_fp4(w, fmt)
    deq = fp4.dequantize_fp4(packed, scale, fmt, glob)
    rel = (deq - w).norm() / w.norm()
    assert 0 < rel < 0.15
    p2, s2, g2 = fp4.quantize_fp4(deq, fmt)
    assert torch.allclose(fp4.dequantize_fp4(p2, s2, fmt, g2), deq, rtol=1e-6, atol=0)


def test_bad_shapes_and_formats_are_named():
    with pytest.raises(ValueError, match="Unknown FP4 expert format"):
        fp4.get_format("fp8")
    with pytest.raises(ValueError, match="scale shape"):
        fp4.dequantize_fp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8), "mxfp4")
    with pytest.raises(ValueError, match="group size"):
        fp4.quantize_fp4(torch.randn(4, 40), "mxfp4")
