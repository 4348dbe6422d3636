"""The `pca` codec: a calibration fitted to sample KV, variable-length entries (format 4) that round-trip within the
calibrated error, damage and foreign calibrations as misses, and the engine fitting, keeping and reusing it."""

from __future__ import annotations

import logging
import struct

import pytest
import torch
import zstandard
from store_helpers import D, H, L, structured_kv

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.errors import ConfigError, CorruptEntryError
from cacheblend_rag.store.chunk_kv import ChunkKV
from cacheblend_rag.store.codec import get_codec
from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.serialize import (
    VARIABLE_VERSION,
    deserialize_chunk,
    layer_digest,
    parse_layout,
    serialize_chunk,
)
from cacheblend_rag.store.transform_codec import REL_MSE, KVCalibration, TransformCodec, component_groups
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words


@pytest.fixture(scope="module")
def codec() -> TransformCodec:
    return TransformCodec(KVCalibration.fit(*structured_kv(400, seed=0)))


def test_a_round_trip_has_the_calibrated_error_and_far_fewer_bytes_than_int8(codec):
    k, v = structured_kv(300, seed=1)
    kv = ChunkKV("c" * 64, k, v)
    data = serialize_chunk(kv, codec=codec)
    out = deserialize_chunk(data, kv.key, codec=codec)
    for got, want, rel in ((out.keys, k, REL_MSE[0]), (out.values, v, REL_MSE[1])):
        mse = (got - want).pow(2).mean()
        variance = (want - want.mean(2, keepdim=True)).pow(2).mean()
        assert 0.5 * rel < mse / variance < 1.5 * rel  # uniform rounding: step^2 / 12, as calibrated
    int8 = serialize_chunk(kv, codec=get_codec("int8"))
    assert len(data) < 0.6 * len(int8)
    layout = parse_layout(data, kv.key, len(data), codec=codec)
    sizes = {layout.layer_nbytes(i) for i in range(L)}
    assert len(sizes) > 1 and layout.payload_nbytes == sum(layout.layer_nbytes(i) for i in range(L))


def test_values_beyond_int8_codes_come_back_exactly_as_coded(codec):
    k, v = structured_kv(50, seed=2)
    k[1, 0, 7, 5] = 5e4  # thousands of steps away: outside the int8 codes, kept beside them
    kv = ChunkKV("o" * 64, k, v)
    out = deserialize_chunk(serialize_chunk(kv, codec=codec), kv.key, codec=codec)
    step = float(codec.calibration.step[1, 0].max())
    assert (out.keys - k).abs().max() <= step  # within one step everywhere, the outlier included


def test_entries_read_layer_by_layer_from_the_disk_tier(tmp_path, codec):
    store = DiskStore(tmp_path, 10 * 1024**2, codec=codec)
    k, v = structured_kv(120, seed=3)
    store.put(ChunkKV("d" * 64, k, v))
    hit = store.open("d" * 64)
    assert hit is not None
    whole = deserialize_chunk(serialize_chunk(ChunkKV("d" * 64, k, v), codec=codec), "d" * 64, codec=codec)
    for i in (2, 0, 1):  # any order: each layer is its own byte range
        got_k, got_v = hit.kv.layer(i)
        assert torch.equal(got_k, whole.keys[i]) and torch.equal(got_v, whole.values[i])


def test_damage_a_foreign_calibration_and_an_unknown_version_are_corrupt_entries(codec):
    k, v = structured_kv(60, seed=4)
    kv = ChunkKV("e" * 64, k, v)
    data = serialize_chunk(kv, codec=codec)
    layout = parse_layout(data, kv.key, len(data), codec=codec)
    (k0, k1), (v0, v1) = layout.layer_ranges(1)
    damaged = bytearray(data)
    damaged[k1 - 3] ^= 0xFF
    with pytest.raises(CorruptEntryError, match="sha256"):
        deserialize_chunk(bytes(damaged), kv.key, codec=codec)
    # damage with its checksum rewritten (a forger, or a bug upstream of the checksum): the frame itself refuses
    new = layer_digest(bytes(damaged[k0:k1]), bytes(damaged[v0:v1]))
    forged = bytes(damaged).replace(layout.layer_sha256[1].encode(), new.encode())
    with pytest.raises(CorruptEntryError, match="pca payload|NaN"):
        deserialize_chunk(forged, kv.key, codec=codec)
    other = TransformCodec(KVCalibration.fit(*structured_kv(400, seed=5)))
    with pytest.raises(CorruptEntryError, match="written with codec"):
        deserialize_chunk(data, kv.key, codec=other)
    unknown = data.replace(f'"version":"{VARIABLE_VERSION}"'.encode(), b'"version":"9"')
    assert unknown != data
    with pytest.raises(CorruptEntryError, match="format version '9'"):
        deserialize_chunk(unknown, kv.key, codec=codec)


def test_each_group_of_component_ranks_is_a_frame_of_its_own_and_the_header_must_agree(codec):
    assert component_groups(16) == [(0, 4), (4, 8), (8, 16)]
    assert component_groups(64) == [(0, 4), (4, 8), (8, 16), (16, 32), (32, 64)] and component_groups(3) == [(0, 3)]
    k, _ = structured_kv(40, seed=7)
    codes = codec.codes(k[1], 1, 0)  # [H, D, T]
    payload = codec.pack(codes)
    n_wide, *lengths = struct.unpack_from("<4I", payload)
    start = 16 + 8 * n_wide
    for (a, b), length in zip(component_groups(D), lengths, strict=True):  # ranks a..b-1 of every head, in order
        raw = zstandard.ZstdDecompressor().decompress(payload[start : start + length])
        assert raw == codes[:, a:b].clamp(-127, 127).to(torch.int8).contiguous().numpy().tobytes()
        start += length
    assert start == len(payload) and torch.equal(codec.unpack(payload, (H, 40, D)), codes.float())
    swapped = struct.pack("<4I", n_wide, lengths[1], lengths[0], lengths[2]) + payload[16:]
    with pytest.raises(CorruptEntryError, match="pca payload"):
        codec.unpack(swapped, (H, 40, D))


def test_entries_of_the_one_frame_layout_are_misses_not_misread(codec):
    kv = ChunkKV("f" * 64, *structured_kv(30, seed=8))
    writer = TransformCodec(codec.calibration)
    assert writer.name == codec.name and codec.name.startswith("pca2-")
    writer.name = f"pca-{codec.calibration.digest[:16]}"  # the name entries of the one-frame layout were written under
    with pytest.raises(CorruptEntryError, match="written with codec"):
        deserialize_chunk(serialize_chunk(kv, codec=writer), kv.key, codec=codec)


def test_a_layer_of_another_shape_is_refused_and_the_name_alone_needs_an_engine(codec):
    with pytest.raises(ValueError, match="calibration is for 2 KV heads of 16 dims"):
        codec.encode(torch.zeros(4, 5, 16), torch.zeros(4, 5, 16), 0)
    with pytest.raises(ConfigError, match="fitted to a model"):
        get_codec("pca")


def test_a_calibration_saves_and_loads_itself_and_refuses_a_damaged_file(tmp_path, codec):
    path = tmp_path / "cal.safetensors"
    codec.calibration.save(path)
    loaded = KVCalibration.load(path)
    assert loaded.digest == codec.calibration.digest and TransformCodec(loaded).name == codec.name
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        KVCalibration.load(path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_decoding_on_a_gpu_gives_the_cpu_values(codec):
    k, v = structured_kv(64, seed=6)
    key_payload, value_payload = codec.encode(k[0].cuda(), v[0].cuda(), 0)
    cpu = codec.decode(key_payload, value_payload, (H, 64, D), torch.float32, 0)
    codes = codec.unpack(key_payload, (H, 64, D)).cuda()
    gpu = codec.values_of(codes, 0, 0, torch.float32)
    assert torch.allclose(gpu.cpu(), cpu[0], atol=1e-4)


def test_the_engine_fits_keeps_and_reuses_its_calibration_and_blends_from_pca_entries(tmp_path, caplog):
    chunks = [random_words(i, 30) for i in range(3)]

    def engine(folder):
        config = EngineConfig(chunk_separator="", store=StoreConfig(memory_budget_bytes=0, disk_dir=str(folder),
                                                                    kv_codec="pca"))  # fmt: skip
        return CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)

    first = engine(tmp_path / "kv")
    kept = list((tmp_path / "kv" / "calibration").glob("*.safetensors"))
    assert len(kept) == 1
    codec = first.store.tiers[1].codec
    assert isinstance(codec, TransformCodec)
    first.precompute(chunks, "a question?")
    first.store.flush()
    prompt = first.build_prompt(chunks, "a question?")
    reuse = first.prefill(prompt, "reuse").logits
    full = first.prefill(prompt, "full").logits
    assert torch.allclose(reuse, full, atol=0.2 * full.abs().max().item())
    second = engine(tmp_path / "kv")  # reads the kept calibration: the same codec, so the entries hit
    assert second.store.tiers[1].codec.name == codec.name
    again = second.prefill(second.build_prompt(chunks, "a question?"), "reuse")
    assert again.metrics.hits_by_tier["disk"] == len(chunks) and torch.equal(again.logits, reuse)
    kept[0].write_bytes(b"not a calibration")
    with caplog.at_level(logging.WARNING):
        third = engine(tmp_path / "kv")
    assert "unreadable" in caplog.text and third.store.tiers[1].codec.name == codec.name  # fitted again, the same


def test_the_calibration_pass_reads_the_keys_and_values_a_chunk_prefill_stores():
    from cacheblend_rag.engine.chunks.calibrate import calibration_kv, calibration_paragraphs
    from cacheblend_rag.engine.request.prompt import encode

    engine = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(chunk_separator=""))
    keys, values = calibration_kv(engine.lm, engine.tokenizer, (1, 2, 3))
    first = encode(engine.tokenizer, calibration_paragraphs()[0])
    kv = engine.chunks.prefill(engine.chunks.load_prefix((1, 2, 3)).kv, (1, 2, 3), first, isolated=True)
    n = len(first)
    assert torch.allclose(keys[:, :, :n], kv.keys.float(), atol=1e-4)
    assert torch.allclose(values[:, :, :n], kv.values.float(), atol=1e-4)


def test_the_memory_tier_can_keep_pca_entries_without_a_disk_folder():
    chunks = [random_words(i + 10, 25) for i in range(2)]
    config = EngineConfig(chunk_separator="", store=StoreConfig(memory_codec="pca"))
    engine = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)
    codec = engine.store.tiers[0].codec
    assert isinstance(codec, TransformCodec)
    engine.precompute(chunks, "why?")
    prompt = engine.build_prompt(chunks, "why?")
    result = engine.prefill(prompt, "reuse")
    assert result.metrics.hits_by_tier == {"memory": len(chunks)}
    full = engine.prefill(prompt, "full").logits
    assert torch.allclose(result.logits, full, atol=0.2 * full.abs().max().item())
