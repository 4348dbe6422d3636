"""The memory tier's eviction policies: least recently used, and least frequently used with aging (LFU-DA)."""

from __future__ import annotations

import pytest
import torch

from cacheblend_rag.config import StoreConfig
from cacheblend_rag.config.store_config import EVICTION_NAMES
from cacheblend_rag.errors import ConfigError
from cacheblend_rag.store import ChunkKV, MemoryStore, build_store
from cacheblend_rag.store.eviction import EVICTION_POLICIES, EvictionOrder, LFUOrder, LRUOrder, eviction_order


def kv(name: str, tokens: int = 4) -> ChunkKV:
    t = torch.zeros((1, 1, tokens, 8))  # 128 bytes per tensor at 4 tokens: 256 per entry
    return ChunkKV(name, t, t.clone())


ENTRY = kv("x").nbytes


def test_lru_evicts_the_entry_used_longest_ago():
    store = MemoryStore(3 * ENTRY, eviction="lru")
    for name in "abc":
        store.put(kv(name))
    assert store.open("a") is not None  # a is now the most recent
    store.put(kv("d"))
    assert "b" not in store and all(k in store for k in "acd")


def test_lfu_keeps_the_entry_used_most_over_one_used_once():
    store = MemoryStore(3 * ENTRY, eviction="lfu")
    for name in "abc":
        store.put(kv(name))
    for _ in range(3):
        assert store.open("a") is not None
    assert store.open("b") is not None
    store.open("c")
    store.put(kv("d"))  # b and c tie at 2 uses, b used longer ago; a has 4; d, just written, is not a victim
    assert "a" in store and "d" in store and "b" not in store
    # LRU would have evicted a here had it been read first: that is the difference
    lru = MemoryStore(3 * ENTRY, eviction="lru")
    for name in "abc":
        lru.put(kv(name))
    for name in ("a", "a", "a", "b", "c"):
        lru.open(name)
    lru.put(kv("d"))
    assert "a" not in lru


def test_lfu_ages_out_an_entry_popular_long_ago():
    order = LFUOrder()
    order.add("old", 1)
    for _ in range(5):
        order.touch("old")  # 6 uses, then never again
    # newer entries each used twice, evicted one after another: every victim raises the age newcomers start from
    victims = []
    for i in range(10):
        order.add(f"n{i}", 1)
        order.touch(f"n{i}")
        if len(order) > 2:
            victims.append(order.victim())
    assert "old" in victims  # LFU without aging would keep it for ever


def test_ties_go_least_recently_used_first_and_removed_keys_are_never_victims():
    order = LFUOrder()
    for name in "abc":
        order.add(name, 1)
    order.remove("a")
    assert order.victim() == "b"
    assert order.victim() == "c"
    with pytest.raises(KeyError):
        order.victim()


def test_a_discarded_or_cleared_entry_leaves_the_order():
    store = MemoryStore(2 * ENTRY, eviction="lfu")
    store.put(kv("a"))
    store.put(kv("b"))
    store.discard("a")
    assert len(store.eviction) == 1
    store.put(kv("c"))
    assert "b" in store and "c" in store and store.stats.evictions == 0
    store.clear()
    assert len(store.eviction) == 0 and store.nbytes == 0


def test_rewriting_an_entry_counts_its_bytes_once():
    store = MemoryStore(2 * ENTRY, eviction="lfu")
    store.put(kv("a"))
    store.put(kv("a"))
    store.put(kv("b"))
    assert store.nbytes == 2 * ENTRY and len(store) == 2 and len(store.eviction) == 2 and store.stats.evictions == 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_store_stays_within_its_budget(policy):
    store = MemoryStore(5 * ENTRY + 10, eviction=policy)
    for i in range(40):
        store.put(kv(f"k{i}"))
        store.open(f"k{i // 2}")
        assert store.nbytes <= store.budget_bytes
        assert len(store) == len(store.eviction)
    assert store.stats.evictions == 40 - len(store)


def test_an_unknown_policy_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="eviction must be one of lru, lfu, got 'fifo'"):
        MemoryStore(eviction="fifo")
    with pytest.raises(ConfigError, match="memory_eviction must be one of lru, lfu, got 'mru'"):
        StoreConfig(memory_eviction="mru")
    with pytest.raises(ConfigError, match="an EvictionOrder"):
        eviction_order(42)  # type: ignore[arg-type]


def test_the_settings_name_the_policies_the_store_has():
    assert tuple(EVICTION_POLICIES) == EVICTION_NAMES
    assert isinstance(LRUOrder(), EvictionOrder) and isinstance(LFUOrder(), EvictionOrder)


def test_store_config_reaches_the_memory_tier():
    for policy in EVICTION_NAMES:
        store = build_store(**StoreConfig(memory_eviction=policy).build_options())
        assert store.tiers[0].eviction.name == policy
    assert build_store(**StoreConfig().build_options()).tiers[0].eviction.name == StoreConfig().memory_eviction


def test_a_custom_order_is_used_as_given():
    class NewestFirst(LRUOrder):
        def victim(self, keep: str | None = None) -> str:
            key = next(k for k in reversed(self._keys) if k != keep)
            del self._keys[key]
            return key

    store = MemoryStore(2 * ENTRY, eviction=NewestFirst())
    for name in "abc":
        store.put(kv(name))
    assert "a" in store and "c" in store and "b" not in store  # LRU would have evicted a
