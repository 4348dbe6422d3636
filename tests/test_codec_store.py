"""Codecs in the stored format and the tiers: the header names the codec, checksums cover the encoded bytes, an
entry of another codec or of the previous format is a counted miss, layers decode one at a time (on the loading
thread, never a whole entry up front), and the engine's config picks a codec per tier."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save as st_save
from store_helpers import make_kv, same

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store.chunk_kv import ChunkKV
from cacheblend_rag.store.codec import CALIBRATED_CODECS, CODECS, KVCodec, PayloadSpec
from cacheblend_rag.store.disk.tier import DiskStore
from cacheblend_rag.store.lazy import LazyChunkKV
from cacheblend_rag.store.memory import MemoryStore
from cacheblend_rag.store.serialize import CorruptEntryError, deserialize_chunk, parse_layout, serialize_chunk
from cacheblend_rag.store.tiered import TieredStore, build_store
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

HMAC_KEY = b"a secret of sixteen bytes or more"


def header(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n])


@pytest.mark.parametrize("name", ["fp16", "int8", "int4"])
def test_an_encoded_entry_names_its_codec_and_round_trips_through_bytes(name):
    kv = make_kv("chunk-a", tokens=40)
    data = serialize_chunk(kv, codec=CODECS[name], hmac_key=HMAC_KEY)
    assert header(data)["__metadata__"]["codec"] == name
    out = deserialize_chunk(data, "chunk-a", codec=CODECS[name], hmac_key=HMAC_KEY)
    assert out.dtype == kv.dtype and out.shape == kv.shape
    assert (out.keys - kv.keys).abs().max() < 0.3 and (out.values - kv.values).abs().max() < 0.3
    assert len(data) < len(serialize_chunk(kv))


def test_layers_of_an_encoded_entry_are_known_byte_ranges_checked_on_their_encoded_bytes():
    kv = make_kv("chunk-a", tokens=40)
    data = bytearray(serialize_chunk(kv, codec=CODECS["int8"]))
    layout = parse_layout(bytes(data), "chunk-a", len(data), codec=CODECS["int8"])
    whole = deserialize_chunk(bytes(data), "chunk-a", codec=CODECS["int8"])
    for i in range(kv.num_layers):
        (k0, k1), (v0, v1) = layout.layer_ranges(i)
        assert (k1 - k0, v1 - v0) == CODECS["int8"].payload_spec((2, 40, 8), torch.float32).nbytes()
        k, v = layout.decode_layer(i, data[k0:k1], data[v0:v1])
        assert torch.equal(k, whole.keys[i]) and torch.equal(v, whole.values[i])
    (_, _), (v0, _) = layout.layer_ranges(1)
    data[v0] ^= 0x01  # one bit of layer 1's value scales
    (k0, k1), (v0, v1) = layout.layer_ranges(1)
    with pytest.raises(CorruptEntryError, match="layer 1 fails its sha256"):
        layout.decode_layer(1, data[k0:k1], data[v0:v1])


def test_tiers_of_two_codecs_on_one_folder_keep_their_own_entries(tmp_path):
    int8 = DiskStore(tmp_path, 10 * 1024**2, codec="int8")
    int8.put(make_kv("chunk-a"))
    with pytest.raises(CorruptEntryError, match="written with codec 'int8', this tier reads 'native'"):
        deserialize_chunk(serialize_chunk(make_kv("chunk-a"), codec=CODECS["int8"]), "chunk-a")
    native = DiskStore(tmp_path, 10 * 1024**2, codec="native")
    assert native.entry_name("chunk-a") != int8.entry_name("chunk-a")
    assert native.get("chunk-a") is None  # the int8 entry is not this tier's: a plain miss, nothing dropped
    assert native.stats.misses == 1 and native.stats.corrupt == 0 and native.stats.hits == 0
    assert native.open("chunk-a") is None and "chunk-a" not in native and "chunk-a" in int8
    native.put(make_kv("chunk-a"))  # the miss is recomputed and stored beside it, in this tier's codec
    assert same(native.get("chunk-a"), make_kv("chunk-a"))
    assert int8.get("chunk-a") is not None and int8.stats.corrupt == 0  # the int8 entry is still there


def previous_format_entry(kv) -> bytes:
    """An entry exactly as the format before codecs wrote it: version 2, no codec, compute-dtype tensors."""
    keys, values = kv.keys.contiguous(), kv.values.contiguous()
    digests = []
    for i in range(kv.num_layers):
        h = hashlib.sha256()
        h.update(keys[i].numpy().tobytes())
        h.update(values[i].numpy().tobytes())
        digests.append(h.hexdigest())
    meta = {
        "format": "cacheblend-rag/chunk-kv",
        "version": "2",
        "key": kv.key,
        "dtype": "float32",
        "shape": ",".join(str(s) for s in kv.shape),
        "layer_sha256": ",".join(digests),
    }
    return st_save({"keys": keys, "values": values}, metadata=meta)


def test_an_entry_in_the_previous_format_is_a_counted_miss(tmp_path):
    diskcache = pytest.importorskip("diskcache")
    kv = make_kv("chunk-a", tokens=1024)  # a file in the disk tier, read by range
    store = DiskStore(tmp_path, 10 * 1024**2)
    # written by the previous version under this tier's name (an entry of before names existed is never looked up)
    diskcache.Cache(str(tmp_path)).set(store.entry_name("chunk-a"), previous_format_entry(kv))
    assert store.open("chunk-a") is None
    assert store.stats.misses == 1 and store.stats.corrupt == 1 and "chunk-a" not in store
    with pytest.raises(CorruptEntryError, match="format version '2'"):
        deserialize_chunk(previous_format_entry(kv), "chunk-a")


class CountingCodec:
    """int8 that counts the layers it decodes (the public codec interface, wrapped)."""

    name = "int8"

    def __init__(self) -> None:
        self.decoded = 0

    def payload_spec(self, shape, dtype) -> PayloadSpec:
        return CODECS["int8"].payload_spec(shape, dtype)

    def encode(self, k, v, layer):
        return CODECS["int8"].encode(k, v, layer)

    def decode(self, key_payload, value_payload, shape, dtype, layer):
        self.decoded += 1
        return CODECS["int8"].decode(key_payload, value_payload, shape, dtype, layer)


@pytest.mark.parametrize("tier", ["disk", "memory"])
def test_an_encoded_hit_decodes_each_layer_when_it_is_read_and_not_before(tmp_path, tier):
    codec = CountingCodec()
    assert isinstance(codec, KVCodec)
    store = DiskStore(tmp_path, 10 * 1024**2, codec=codec) if tier == "disk" else MemoryStore(codec=codec)
    kv = make_kv("chunk-a", tokens=1024)
    store.put(kv)
    hit = store.open("chunk-a")
    assert hit is not None and isinstance(hit.kv, LazyChunkKV) and codec.decoded == 0
    k, _ = hit.kv.layer(1)
    assert codec.decoded == 1 and (k - kv.keys[1]).abs().max() < 0.05
    hit.kv.materialize()
    assert codec.decoded == kv.num_layers


def test_an_encoded_memory_tier_holds_more_chunks_in_the_same_budget():
    budget = 4 * make_kv("x", tokens=64).nbytes
    native, int8 = MemoryStore(budget), MemoryStore(budget, codec="int8")
    for i in range(12):
        native.put(make_kv(f"chunk-{i}", tokens=64, seed=i))
        int8.put(make_kv(f"chunk-{i}", tokens=64, seed=i))
    # [2, 2, 64, 8] fp32: int8 codes are a quarter, the header and the scales of 8-dim rows take some back
    assert len(native) == 4 and len(int8) >= 8 and int8.nbytes <= budget
    got = int8.get("chunk-11")
    assert got is not None and (got.values - make_kv("c", tokens=64, seed=11).values).abs().max() < 0.05


def test_a_disk_hit_is_promoted_into_memory_in_the_memory_tiers_codec(tmp_path):
    memory, disk = MemoryStore(10 * 1024**2), DiskStore(tmp_path, 10 * 1024**2, codec="int4")
    store = TieredStore([memory, disk], write_back=False)
    kv = make_kv("chunk-a", tokens=64)
    disk.put(kv)
    store.open("chunk-a").kv.materialize()
    promoted, tier = store.open("chunk-a")
    assert tier == "memory" and not isinstance(promoted, LazyChunkKV)  # kept decoded: memory's codec is native
    assert (promoted.keys - kv.keys).abs().max() < 0.5


def test_the_disk_tier_stores_int8_by_default_and_the_memory_tier_native(tmp_path):
    g = torch.Generator().manual_seed(0)
    shape = (2, 2, 256, 128)  # [L, Hkv, T, D] fp32, 256 KiB a tensor: files on disk; 128 dims keep the scales small
    kv = ChunkKV("chunk-a", torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    exact = DiskStore(tmp_path / "native", 10 * 1024**2, codec="native")
    default = DiskStore(tmp_path / "default", 10 * 1024**2)
    tiered = build_store(memory_bytes=0, disk_dir=tmp_path / "tiered", disk_bytes=10 * 1024**2)
    memory, disk = tiered.tiers
    assert default.codec.name == disk.codec.name == "int8" and memory.codec.name == "native"
    for store in (exact, default, tiered):
        store.put(kv)
    tiered.flush()

    def on_disk(name: str) -> int:
        return sum(f.stat().st_size for f in (tmp_path / name).rglob("*.val"))

    # int8 codes are a quarter of fp32; a scale and a low per key channel and per value token add a few percent
    assert 0.25 < on_disk("default") / on_disk("native") < 0.3
    assert 0.25 < on_disk("tiered") / on_disk("native") < 0.3
    for out in (default.get("chunk-a"), tiered.get("chunk-a")):
        assert out.dtype == kv.dtype and out.shape == kv.shape
        for got, want in ((out.keys, kv.keys), (out.values, kv.values)):
            step = (want.max() - want.min()).item() / 255  # an int8 step over the whole range: >= each axis's step
            assert not torch.equal(got, want) and torch.allclose(got, want, rtol=0, atol=step)
    assert StoreConfig().kv_codec == "int8" and StoreConfig().memory_codec == "native"


# ---------------------------------------------------------------- the engine's settings

CHUNKS = [random_words(501, 40), random_words(502, 30), random_words(503, 50)]


def test_config_names_the_codec_field_value_and_choices():
    names = r"\['bf16', 'fp16', 'int4', 'int8', 'native', 'pca'\]"
    with pytest.raises(ConfigError, match="kv_codec must be one of " + names):
        EngineConfig(store=StoreConfig(kv_codec="int3"))
    with pytest.raises(ConfigError, match="memory_codec must be one of .* got 'zstd'"):
        EngineConfig(store=StoreConfig(memory_codec="zstd"))


def test_the_settings_name_the_codecs_the_store_ships():
    import subprocess
    import sys

    from cacheblend_rag.config import CODEC_NAMES

    assert CODEC_NAMES == tuple(CODECS) + CALIBRATED_CODECS  # config lists them so that it need not import the store
    code = (
        "import sys, cacheblend_rag.config\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cacheblend_rag.store', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engine_stores_disk_entries_in_its_kv_codec_and_blends_from_them(tmp_path):
    def ask(engine):
        return engine.generate(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), max_new_tokens=4)

    engines = {}
    for name in ("native", "int8"):
        config = EngineConfig(
            chunk_separator="", store=StoreConfig(memory_budget_bytes=0, disk_dir=str(tmp_path / name), kv_codec=name)
        )
        engines[name] = CacheBlendEngine(make_tiny_model("llama"), make_tiny_tokenizer(), config=config)
        ask(engines[name])  # cold: answered in full, its chunks stored after the call, in the background
        engines[name].wait_for_fills()
        engines[name].store.flush()
    disk = {name: engine.store.tiers[1] for name, engine in engines.items()}
    assert disk["int8"].codec is CODECS["int8"] and disk["int8"].nbytes < disk["native"].nbytes
    native, int8 = ask(engines["native"]), ask(engines["int8"])
    assert int8.metrics.hits_by_tier["disk"] == native.metrics.hits_by_tier["disk"] >= 3
    prompt = engines["native"].build_prompt(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5))
    a = engines["native"].prefill(prompt, "reuse").logits
    b = engines["int8"].prefill(prompt, "reuse").logits
    assert not torch.equal(a, b) and torch.allclose(a, b, atol=0.05 * a.abs().max().item())


@pytest.mark.parametrize("codec_name", ["native", "int8", "int4"])
def test_a_forged_layer_that_decodes_to_nan_is_a_corrupt_entry_not_nan_logits(codec_name):
    # A forger without the HMAC key can rewrite a layer and its sha256: checksums catch damage, not forgery.
    from store_helpers import make_kv

    from cacheblend_rag.errors import CorruptEntryError
    from cacheblend_rag.store.codec import get_codec
    from cacheblend_rag.store.serialize import deserialize_chunk, layer_digest, parse_layout, serialize_chunk

    codec = get_codec(codec_name)
    kv = make_kv("k" * 64, tokens=8)
    data = bytearray(serialize_chunk(kv, codec=codec))
    layout = parse_layout(bytes(data), kv.key, len(data), codec=codec)
    (k0, k1), (v0, v1) = layout.layer_ranges(0)
    data[k0:k1] = b"\xff" * (k1 - k0)  # every float NaN; every quantizer scale NaN
    old, new = layout.layer_sha256[0], layer_digest(bytes(data[k0:k1]), bytes(data[v0:v1]))
    data = bytearray(bytes(data).replace(old.encode(), new.encode()))
    with pytest.raises(CorruptEntryError, match="NaN or infinity"):
        deserialize_chunk(bytes(data), kv.key, codec=codec)


@pytest.mark.parametrize("codec_name", ["native", "int8"])
def test_kv_holding_inf_is_refused_by_the_encoders_and_never_stored(tmp_path, codec_name, caplog):
    from store_helpers import make_kv

    from cacheblend_rag.errors import NonFiniteKVError
    from cacheblend_rag.store import DiskStore, MemoryStore
    from cacheblend_rag.store.serialize import serialize_chunk

    kv = make_kv("i" * 64, tokens=8)
    kv.keys[1, 0, 3, 2] = float("inf")
    with pytest.raises(NonFiniteKVError, match="NaN or infinity"):
        serialize_chunk(kv, codec=codec_name)
    disk = DiskStore(tmp_path / "kv", budget_bytes=1 << 20, codec=codec_name)
    disk.put(kv)
    assert kv.key not in disk and "NaN or infinity" in caplog.text
    memory = MemoryStore(budget_bytes=1 << 20, codec="int8")
    memory.put(kv)
    assert kv.key not in memory
