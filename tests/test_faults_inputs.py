"""Fault injection at the edges a user or an attacker controls: request arguments, the model fingerprint, index
folders and the command line's --kv-dir. One reproducer per defect the fault-injection review found."""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from cacheblend_rag import CacheBlendEngine, EngineConfig, StoreConfig
from cacheblend_rag.cli import build_parser, main
from cacheblend_rag.errors import ConfigError, PromptError
from cacheblend_rag.models.fingerprint import model_fingerprint
from cacheblend_rag.testing import make_tiny_model, make_tiny_tokenizer, random_words

CHUNKS = [random_words(601, 30), random_words(602, 30)]


@pytest.fixture(scope="module")
def engine() -> CacheBlendEngine:
    return CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )


def ask(engine, chunks=CHUNKS, **kwargs):
    kwargs.setdefault("max_new_tokens", 4)
    return engine.generate(chunks, prefix=random_words(1, 4), suffix=random_words(2, 5), **kwargs)


# ---------------------------------------------------------------- request validation, before any compute


def test_stop_none_means_no_stop_strings(engine):
    assert ask(engine, stop=None).token_ids == ask(engine, stop=()).token_ids


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=math.nan), "temperature must be >= 0"),
        (dict(temperature=math.inf), "temperature must be >= 0"),
        (dict(top_p=math.nan), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=None), "max_new_tokens must be an integer"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
        (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
        (dict(top_k=1.5), "top_k must be an integer"),
        (dict(seed=True), "seed must be an integer"),
        (dict(recompute_ratio=True), "recompute_ratio must be a number"),
        (dict(recompute_ratio=math.nan), r"recompute_ratio must be in \[0, 1\]"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop=[3]), "stop strings must be non-empty strings"),
    ],
)
def test_bad_sampling_arguments_fail_before_any_compute(kwargs, message):
    engine = CacheBlendEngine(
        make_tiny_model("llama"), make_tiny_tokenizer(), config=EngineConfig(miss_policy="blend", chunk_separator="")
    )
    with pytest.raises(ConfigError, match=message):
        engine.stream(CHUNKS, prefix=random_words(1, 4), suffix=random_words(2, 5), **kwargs)
    assert len(engine.store) == 0  # nothing was prefilled


@pytest.mark.parametrize("where", ["chunk", "suffix"])
def test_text_that_cannot_be_encoded_is_a_prompt_error_naming_it(engine, where):
    chunks = [CHUNKS[0], "bad \ud800 text"] if where == "chunk" else CHUNKS
    suffix = "bad \ud800 text" if where == "suffix" else random_words(2, 5)
    with pytest.raises(PromptError, match="chunk 1 holds" if where == "chunk" else "the suffix holds"):
        engine.generate(chunks, prefix=random_words(1, 4), suffix=suffix)
    if where == "chunk":
        with pytest.raises(PromptError, match="chunk 1 holds"):
            engine.precompute(chunks, prefix=random_words(1, 4))


def test_ask_on_a_folder_without_text_files_suggests_a_flag_ask_has(tmp_path, capsys):
    (tmp_path / "page.html").write_text("<p>no .txt here</p>")
    assert main(["ask", "--docs", str(tmp_path), "question?"]) == 2
    assert "--suffix" in capsys.readouterr().err
    ask_parser = build_parser()._subparsers._group_actions[0].choices["ask"]
    assert "--suffix" in ask_parser._option_string_actions


# ---------------------------------------------------------------- the model fingerprint


def test_noise_on_one_layer_changes_the_fingerprint():
    model = make_tiny_model("llama")
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[2].self_attn.k_proj.weight.add_(
            torch.randn_like(tuned.model.layers[2].self_attn.k_proj.weight)
        )
    assert model_fingerprint(model) != model_fingerprint(tuned)


def test_changing_any_single_weight_changes_the_fingerprint():
    model = make_tiny_model("qwen2")
    base = model_fingerprint(model)
    assert model_fingerprint(make_tiny_model("qwen2")) == base  # the same weights: the same fingerprint
    for name, param in model.named_parameters():
        with torch.no_grad():
            flat = param.view(-1)
            old = flat[flat.numel() // 2].clone()
            flat[flat.numel() // 2] += 0.5
            assert model_fingerprint(model) != base, f"a change to {name} left the fingerprint unchanged"
            flat[flat.numel() // 2] = old
    assert model_fingerprint(model) == base


def test_a_checkpoint_fingerprint_hashes_the_files_once_and_sees_edits_after_loading(tmp_path):
    from transformers import AutoModelForCausalLM

    make_tiny_model("llama").save_pretrained(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    first = model_fingerprint(loaded)
    sidecar = tmp_path / "ckpt" / ".cacheblend-fingerprint.json"
    cached = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**cached, "sha256": "0" * 64}))  # a later load reads the cache, not the files
    assert model_fingerprint(loaded) != first
    sidecar.unlink()
    assert model_fingerprint(loaded) == first
    with torch.no_grad():
        loaded.model.layers[1].mlp.down_proj.weight.mul_(1.01)  # edited in memory after loading (a merged LoRA)
    assert model_fingerprint(loaded) != first
    other = make_tiny_model("llama", seed=1)
    other.save_pretrained(tmp_path / "ckpt")  # other weights in the same folder: other file content
    assert model_fingerprint(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")) != first


# ---------------------------------------------------------------- index folders that claim more than they hold


def test_the_flat_index_check_passes_what_faiss_writes(tmp_path):
    import faiss
    import numpy as np

    from cacheblend_rag.retrieval.faiss_file import flat_index_problem

    for index in (faiss.IndexFlatIP(8), faiss.IndexFlatL2(8)):
        index.add(np.ones((3, 8), dtype="float32"))
        faiss.write_index(index, str(tmp_path / "x.faiss"))
        assert flat_index_problem(tmp_path / "x.faiss", dim=8, count=3) is None
        assert "expected 4" in flat_index_problem(tmp_path / "x.faiss", dim=8, count=4)


def crafted_faiss_file(path: Path, dim: int = 384) -> None:
    """3 KB that claim 2^28 floats: FAISS would allocate 1 GB before noticing the file is short."""
    header = struct.pack("<4siqqqBiQ", b"IxFI", dim, 2**28 // dim, 1 << 20, 1 << 20, 1, 0, (2**28 // dim) * dim)
    path.write_bytes(header + b"\0" * 3000)


def test_a_crafted_core_index_is_refused_before_faiss_reads_it(tmp_path, monkeypatch):
    import faiss

    from cacheblend_rag.retrieval import ChunkIndex
    from cacheblend_rag.retrieval.chunking import Chunk
    from cacheblend_rag.retrieval.index import IndexFormatError

    class TinyEmbedder:
        def encode(self, texts, **kwargs):
            return torch.ones(len(texts), 8).numpy()

        def get_sentence_embedding_dimension(self):
            return 8

    chunks = [Chunk(random_words(i, 8), "a.txt", i, 8) for i in range(3)]
    folder = ChunkIndex.build(chunks, TinyEmbedder()).save(tmp_path / "index")
    crafted_faiss_file(folder / "index.faiss", dim=8)
    manifest = json.loads((folder / "chunks.json").read_text())
    import hashlib

    manifest["index_sha256"] = hashlib.sha256((folder / "index.faiss").read_bytes()).hexdigest()  # forged too
    (folder / "chunks.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(faiss, "read_index", lambda *a: pytest.fail("FAISS read a crafted file"))
    with pytest.raises(IndexFormatError, match="cannot be loaded: its header describes .* the file holds 3045 bytes"):
        ChunkIndex.load(folder, TinyEmbedder(), model_name="custom")


def test_a_crafted_langchain_index_is_refused_before_faiss_reads_it(tmp_path, monkeypatch):
    pytest.importorskip("langchain_cacheblend")
    import faiss
    from langchain_cacheblend.vectorstores.faiss import build_faiss_index, load_faiss_index, save_faiss_index
    from langchain_core.documents import Document

    store = build_faiss_index([Document(page_content=random_words(i, 8)) for i in range(3)])
    save_faiss_index(store, tmp_path / "index")
    (index_file,) = [p for p in (tmp_path / "index").iterdir() if p.suffix == ".faiss"]
    crafted_faiss_file(index_file)
    monkeypatch.setattr(faiss, "read_index", lambda *a: pytest.fail("FAISS read a crafted file"))
    with pytest.raises(ValueError, match="cannot be loaded: its header describes .* the file holds 3045 bytes"):
        load_faiss_index(tmp_path / "index")


def test_a_crafted_llama_index_is_refused_before_faiss_reads_it(tmp_path, monkeypatch):
    pytest.importorskip("llama_index.response_synthesizers.cacheblend")
    import faiss
    from llama_index.core.schema import Document
    from llama_index.response_synthesizers.cacheblend import build_faiss_index, load_faiss_index

    build_faiss_index([Document(text=random_words(i, 8)) for i in range(3)], persist_dir=tmp_path / "index")
    crafted_faiss_file(tmp_path / "index" / "default__vector_store.json")
    monkeypatch.setattr(faiss, "read_index", lambda *a: pytest.fail("FAISS read a crafted file"))
    with pytest.raises(ValueError, match="cannot be loaded: its header describes .* the file holds 3045 bytes"):
        load_faiss_index(tmp_path / "index")


# ---------------------------------------------------------------- --kv-dir problems on the command line


@pytest.mark.parametrize("problem", ["a file", "a garbled cache.db"])
def test_a_bad_kv_dir_is_an_error_line_and_exit_code_2_before_a_model_loads(tmp_path, capsys, no_model_loads, problem):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(random_words(3, 30))
    kv = tmp_path / "kv"
    if problem == "a file":
        kv.write_text("a file")
    else:
        kv.mkdir()
        (kv / "cache.db").write_bytes(b"garbage" * 500)
    for command in (["ask", "--docs", str(tmp_path / "docs")], ["profile", "--out", str(tmp_path / "p.json")]):
        assert main([*command, "--kv-dir", str(kv), *(["question?"] if command[0] == "ask" else [])]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: the disk tier folder") and str(kv) in err and "Traceback" not in err


def test_the_fingerprint_sample_reaches_the_last_value_of_a_huge_tensor():
    from cacheblend_rag.models.fingerprint import _sample_digest

    big = torch.zeros(2**24 + 3)  # past float32's exact integers, where float spacing rounds out of range
    before = _sample_digest([("w", big)])
    big[-1] = 1.0
    assert _sample_digest([("w", big)]) != before


def test_a_redis_password_never_shows_in_the_config_or_its_errors():
    from cacheblend_rag.config.checks import mask_url
    from cacheblend_rag.store.redis_store import RedisStore

    secret = "S3cretPassw0rd"
    config = EngineConfig(store=StoreConfig(redis_url=f"redis://:{secret}@127.0.0.1:1/0", hmac_key="k" * 20))
    assert secret not in repr(config) and secret not in str(config) and "k" * 20 not in repr(config)
    assert "redis://:***@127.0.0.1:1/0" in repr(config)
    with pytest.raises(ConfigError) as bad_scheme:
        EngineConfig(store=StoreConfig(redis_url=f"http://user:{secret}@host/0"))
    assert secret not in str(bad_scheme.value) and "user:***@host" in str(bad_scheme.value)
    pytest.importorskip("redis")
    with pytest.raises(ConfigError) as cluster_db:
        RedisStore(f"redis://:{secret}@127.0.0.1:1/3?cluster=1")
    assert secret not in str(cluster_db.value)
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
