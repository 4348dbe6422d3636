"""Fault injection into the disk tier's folder and the model fingerprint's cached digest.

Someone with write access to a cache folder (or a careless setting) plants symlinks, points the tier at a folder
that is not a store, or edits a checkpoint in place. No write may leave the store folder, a folder that is not a
store is refused at open naming it, and a changed checkpoint never inherits the old fingerprint.
(`tests/test_faults_store_index.py` covers what can be planted inside `cache.db`.)
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest
from store_helpers import make_kv

from cacheblend_rag.errors import ConfigError
from cacheblend_rag.models.fingerprint import checkpoint_digest
from cacheblend_rag.store import DiskStore, check_disk_dir

BIG = 1024  # tokens: above diskcache's 32 KiB threshold, so the entry is a value file named in cache.db
MB = 1024**2


def files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


# ---------------------------------------------------------------- no write leaves the store folder


def test_a_value_folder_planted_as_a_symlink_never_receives_a_write(tmp_path):
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB)
    outside = tmp_path / "outside"
    for i in range(256):  # every first-level value folder, so whatever name the write draws goes through one
        (outside / f"{i:02x}").mkdir(parents=True)
        (tmp_path / "kv" / f"{i:02x}").symlink_to(outside / f"{i:02x}")
    store.put(make_kv("chunk-a", tokens=BIG))
    assert files_under(outside) == []
    assert store.stats.errors == 1 and store.stats.puts == 0 and "chunk-a" not in store
    assert store.get("chunk-a") is None


def test_a_store_folder_holding_a_symlinked_value_folder_is_refused_at_open(tmp_path):
    DiskStore(tmp_path / "kv").close()
    (tmp_path / "outside").mkdir()
    (tmp_path / "kv" / "35").symlink_to(tmp_path / "outside")
    with pytest.raises(ConfigError, match=r"kv.*'35' is a symlink"):
        DiskStore(tmp_path / "kv")


@pytest.mark.parametrize("name", ["cache.db", "cache.db-wal"])
def test_a_cache_db_planted_as_a_symlink_is_refused_and_its_target_never_created(tmp_path, name):
    folder = tmp_path / "kv"
    DiskStore(folder).close()
    for leftover in folder.glob("cache.db*"):
        leftover.unlink()
    target = tmp_path / "outside" / "stolen.db"
    target.parent.mkdir()
    (folder / name).symlink_to(target)
    with pytest.raises(ConfigError, match=rf"{name}.* is a symlink"):
        DiskStore(folder)
    assert not target.exists()


def test_a_failed_value_file_write_leaves_no_file_behind(tmp_path):
    """A full disk: the value file cannot be written whole. No empty or partial `.val` file may stay."""
    store = DiskStore(tmp_path / "kv", budget_bytes=10 * MB)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))  # each entry is 128 KiB
    try:
        for i in range(4):
            store.put(make_kv(f"chunk-{i}", tokens=BIG, seed=i))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert store.stats.errors == 4 and len(store) == 0
    assert list((tmp_path / "kv").rglob("*.val")) == []
    store.put(make_kv("chunk-0", tokens=BIG))  # the tier works on once there is room again
    assert store.get("chunk-0") is not None


# ---------------------------------------------------------------- only an empty folder or a store is opened


def plant(folder: Path, names: list[str]) -> Path:
    for name in names:
        path = folder / name
        if name.endswith("/"):
            path.mkdir(parents=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("keep me")
    return folder


NOT_STORES = {
    "a filesystem root": ["bin/", "etc/passwd", "home/", "usr/", "var/", "vmlinuz"],
    "a home folder": [".bashrc", ".ssh/id_ed25519", "Documents/report.odt"],
    "a documents folder": ["notes.txt", "photos/"],
    "an app's folder with a cache.db": ["cache.db", "settings.ini"],
    "one stray file": ["README"],
}


@pytest.mark.parametrize("kind", list(NOT_STORES))
def test_a_folder_that_is_not_a_store_is_refused_at_open_and_left_untouched(tmp_path, kind):
    folder = plant(tmp_path / "folder", NOT_STORES[kind])
    before = files_under(folder)
    for opener in (DiskStore, check_disk_dir):
        with pytest.raises(ConfigError, match=r"folder .*folder.* is not a cacheblend-rag store.*empty or new folder"):
            opener(folder)
    assert files_under(folder) == before and (folder / "cache.db").exists() == ("cache.db" in NOT_STORES[kind])


def test_the_filesystem_root_is_refused_as_the_disk_folder():
    made = [p for p in ("/cache.db", "/cache.db-wal", "/cache.db-shm") if not os.path.exists(p)]
    try:
        with pytest.raises(ConfigError, match=r"'/' is not a cacheblend-rag store"):
            DiskStore("/")
        assert not any(os.path.exists(p) for p in made)
    finally:
        for p in made:  # what an unguarded tier would have left in the root
            if os.path.exists(p):
                os.remove(p)


@pytest.mark.parametrize("state", ["new", "empty"])
def test_a_new_or_empty_folder_becomes_a_store_with_a_marker(tmp_path, state):
    folder = tmp_path / "kv"
    if state == "empty":
        folder.mkdir()
    store = DiskStore(folder)
    store.put(make_kv("chunk-a"))
    store.close()
    marker = [p for p in folder.iterdir() if p.suffix == ".json"]
    assert len(marker) == 1 and "cacheblend-rag" in json.loads(marker[0].read_text())["format"]
    check_disk_dir(folder)  # a store now: opened again without complaint
    assert DiskStore(folder).get("chunk-a") is not None


def test_a_store_written_before_the_marker_existed_is_still_opened(tmp_path):
    """An older version left a folder holding only diskcache's files: it is a store, and gets its marker."""
    diskcache = pytest.importorskip("diskcache")
    folder = tmp_path / "kv"
    old = DiskStore(folder)
    old.put(make_kv("chunk-a", tokens=BIG))
    old.put(make_kv("chunk-b"))
    old.close()
    for marker in folder.glob("*.json"):
        marker.unlink()
    diskcache.Cache(str(folder)).close()  # as the older version left it: diskcache's files only
    store = DiskStore(folder)
    assert store.get("chunk-a") is not None and store.get("chunk-b") is not None
    assert len(list(folder.glob("*.json"))) == 1


def test_a_marker_folder_that_is_not_diskcaches_database_is_refused(tmp_path):
    folder = tmp_path / "kv"
    DiskStore(folder).close()
    for db in folder.glob("cache.db*"):
        db.unlink()
    with sqlite3.connect(folder / "cache.db") as db:
        db.execute("CREATE TABLE accounts (name TEXT, balance REAL)")
    with pytest.raises(ConfigError, match=r"cache.db.*accounts"):
        DiskStore(folder)
    with sqlite3.connect(folder / "cache.db") as db:  # refused, not repaired: the foreign table is kept
        assert db.execute("SELECT name FROM sqlite_master").fetchall() == [("accounts",)]


# ---------------------------------------------------------------- the fingerprint's cached checkpoint digest


def checkpoint(folder: Path) -> list[Path]:
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return [folder / "model.safetensors"]


def test_a_weight_changed_in_place_with_size_and_mtime_restored_changes_the_digest(tmp_path):
    (weights,) = files = checkpoint(tmp_path / "model")
    original = checkpoint_digest(files)
    st = weights.stat()
    with weights.open("r+b") as f:  # one weight byte, edited in place
        f.seek(1000)
        f.write(b"\xff")
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.stat().st_size == st.st_size and weights.stat().st_mtime_ns == st.st_mtime_ns
    assert checkpoint_digest(files) != original


def test_a_copied_and_edited_checkpoint_does_not_inherit_the_originals_digest(tmp_path):
    files = checkpoint(tmp_path / "model")
    original = checkpoint_digest(files)
    shutil.copytree(tmp_path / "model", tmp_path / "copy")  # copy2: sizes, mtimes and the cached digest come along
    weights = tmp_path / "copy" / "model.safetensors"
    st = weights.stat()
    raw = bytearray(weights.read_bytes())
    raw[1000] ^= 0xFF
    weights.write_bytes(bytes(raw))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert checkpoint_digest([weights]) != original
    assert checkpoint_digest(files) == original  # the original's cached digest still serves the original
