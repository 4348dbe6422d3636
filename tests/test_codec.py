"""The stored-KV codecs as pure functions: round-trip error per codec, exactness of `native`, the int4 nibble
packing, and the quantization axes (keys per channel, values per token)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.codec import (
    CODECS,
    GroupQuantCodec,
    KVCodec,
    dequantize,
    get_codec,
    pack_nibbles,
    quantize,
    unpack_nibbles,
)

SHAPE = (2, 100, 64)  # [Hkv, T, D]: 100 tokens, so int4's groups of 32 along tokens need padding


def random_layer(seed: int = 0, shape=SHAPE, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def round_trip(codec: KVCodec, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    key_payload, value_payload = codec.encode(k, v, 0)
    spec = codec.payload_spec(tuple(k.shape), k.dtype)
    assert key_payload.dtype == value_payload.dtype == spec.dtype
    assert tuple(key_payload.shape) == spec.key_shape and tuple(value_payload.shape) == spec.value_shape
    return codec.decode(key_payload, value_payload, tuple(k.shape), k.dtype, 0)


# Max absolute error on standard normal data (|x| < ~4.5): a 16-bit float's half ulp at that size, a quantization
# step's half (range / (2^bits - 1) / 2, range ~9 over a whole axis, ~5 over a group of 32) with some slack.
MAX_ERROR = {"native": 0.0, "fp16": 2e-3, "bf16": 2e-2, "int8": 0.02, "int4": 0.25}


@pytest.mark.parametrize("name", sorted(CODECS))
def test_each_codec_round_trips_within_its_error_bound(name):
    k, v = random_layer()
    k2, v2 = round_trip(CODECS[name], k, v)
    assert k2.shape == k.shape and v2.shape == v.shape and k2.dtype == v2.dtype == torch.float32
    assert (k2 - k).abs().max() <= MAX_ERROR[name] and (v2 - v).abs().max() <= MAX_ERROR[name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_codec_is_bit_exact(dtype):
    k, v = random_layer(dtype=dtype)
    k2, v2 = round_trip(CODECS["native"], k, v)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_codecs_decode_to_the_models_dtype_and_odd_shapes(name):
    k, v = random_layer(shape=(3, 37, 20), dtype=torch.bfloat16)  # 37 tokens, 20 dims: neither divides by 32
    k2, v2 = round_trip(CODECS[name], k, v)
    assert k2.dtype == v2.dtype == torch.bfloat16 and k2.shape == v2.shape == (3, 37, 20)
    assert (k2.float() - k.float()).abs().max() < 0.3


def test_quantized_payloads_are_smaller_by_the_expected_factor():
    spec = {name: CODECS[name].payload_spec((2, 512, 64), torch.float32) for name in CODECS}
    size = {name: sum(s.nbytes()) for name, s in spec.items()}
    assert size["native"] == 2 * 2 * 512 * 64 * 4 and size["fp16"] == size["native"] // 2
    # int8: 1 byte a value, plus one fp32 scale and low per key channel and per value token
    assert size["int8"] == 2 * 2 * 512 * 64 + 2 * 4 * (2 * 64 + 2 * 512)
    # int4: half a byte a value, plus one fp16 scale and low per group of 32
    assert size["int4"] == 2 * 2 * 512 * 64 // 2 + 2 * 2 * (2 * 2 * 512 * 64 // 32)


# ---------------------------------------------------------------- int4 packing


def test_nibbles_pack_low_first_and_unpack_to_the_same_codes():
    codes = torch.tensor([1, 2, 15, 0, 7, 9], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x21, 0x0F, 0x97]  # code 2i in the low nibble, 2i+1 in the high
    order = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    all_codes = torch.arange(16, dtype=torch.uint8).repeat(8)[order]
    assert torch.equal(unpack_nibbles(pack_nibbles(all_codes)), all_codes)


def test_int4_round_trips_values_on_its_grid_exactly():
    # Every group of 32 (along tokens for a key channel, along dims for a value token) holds the integers 0..15
    # twice in a random order: low 0, scale 1, so the codes are the values, and any slip in packing or group
    # layout (a nibble swap, a shift by one code, a transposed group) shows as an error.
    g = torch.Generator().manual_seed(1)

    def groups(n: int) -> torch.Tensor:  # -> [n, 32]
        return torch.stack([torch.arange(16.0).repeat(2)[torch.randperm(32, generator=g)] for _ in range(n)])

    k = groups(2 * 64 * 2).reshape(2, 64, 2, 32).permute(0, 2, 3, 1).reshape(2, 64, 64)  # [Hkv, T, D]
    v = groups(2 * 64 * 2).reshape(2, 64, 64)
    k2, v2 = round_trip(CODECS["int4"], k, v)
    assert torch.equal(k2, k) and torch.equal(v2, v)


# ---------------------------------------------------------------- quantization axes


def test_keys_use_per_channel_scales_so_an_outlier_channel_leaves_the_others_precise():
    k, v = random_layer()
    k[..., 6] += 100.0  # one outlier channel, as pre-RoPE keys have
    k2, _ = round_trip(CODECS["int8"], k, v)
    others = torch.ones(SHAPE[2], dtype=torch.bool)
    others[6] = False
    per_channel_error = (k2 - k)[..., others].abs().max()
    # The same 8 bits with one scale per token (over dims) must span the outlier: every channel pays for it.
    codes, scale, low = quantize(k, 8, torch.float32)
    per_token_error = (dequantize(codes, scale, low, torch.float32) - k)[..., others].abs().max()
    assert per_channel_error < 0.02 < 0.1 < per_token_error, (per_channel_error, per_token_error)


def test_values_use_per_token_scales_so_an_outlier_token_leaves_the_others_precise():
    k, v = random_layer()
    v[:, 5, :] += 100.0  # one token with large values
    _, v2 = round_trip(CODECS["int8"], k, v)
    others = torch.ones(SHAPE[1], dtype=torch.bool)
    others[5] = False
    assert (v2 - v)[:, others].abs().max() < 0.02  # a scale over all tokens would give steps of ~0.4
    assert (v2 - v)[:, 5].abs().max() < 0.05  # the outlier token is scaled for itself


def test_quantize_never_clamps_with_narrow_scales():
    # Lows and scales are rounded to fp16 away from the data, so the extremes of each group still fit the codes.
    x = torch.tensor([[1000.123, 1000.9, 1000.5, 1000.31]])
    codes, scale, low = quantize(x, 4, torch.float16)
    assert scale.dtype == low.dtype == torch.float16
    assert (dequantize(codes, scale, low, torch.float32) - x).abs().max() <= scale.float().max() / 2 + 1e-3


# ---------------------------------------------------------------- names


def test_codecs_are_found_by_name_and_unknown_names_are_config_errors():
    assert get_codec("int8") is CODECS["int8"] and get_codec(CODECS["int4"]) is CODECS["int4"]
    with pytest.raises(ConfigError, match=r"kv_codec must be one of .*'int4'.*got 'int3'"):
        get_codec("int3", "kv_codec")
    with pytest.raises(ConfigError, match="4 or 8 bits"):
        GroupQuantCodec("int5", bits=5, group=32, scale_dtype=torch.float16)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_keys_decode_to_codes_times_scale_plus_low_of_their_own_channel(name, dtype):
    # The reference, written out: each channel's codes along the tokens (in groups: int4's of 32), times its
    # group's scale plus its low, in float32, then rounded to the model's dtype once; the decoder's fast path
    # (int8 widens the codes in token order) must give exactly that.
    codec = get_codec(name)
    assert isinstance(codec, GroupQuantCodec)
    k, v = random_layer(3, dtype=dtype)
    h, t, d = k.shape
    group = t if codec.group is None else codec.group
    n = -(-t // group)
    padded = torch.cat([k, k[:, -1:].expand(h, n * group - t, d)], dim=1)  # the last token repeated
    codes, scale, low = quantize(padded.reshape(h, n, group, d).transpose(2, 3), codec.bits, codec.scale_dtype)
    want = (codes.float() * scale.float() + low.float()).to(dtype).transpose(2, 3).reshape(h, n * group, d)[:, :t]
    got, _ = round_trip(codec, k, v)
    assert torch.equal(got, want)
