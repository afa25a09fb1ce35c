"""The reference counts a radix manager keeps are released by numpy (``_unref``) and a batch of
decodes is allocated in one call (``allocate_each``): the free stack must come out in exactly the
order the per-slot loops gave, since later allocations hand out its ids (r47)."""

from __future__ import annotations

import random

from tailserve.kv.radix_manager import RadixKVCacheManager


def _loop_release(refs: list[int], free: list[int], table: list[int]) -> None:
    """The per-slot loop ``_release`` ran before r47: tail first, zeros pushed in that order."""
    for block_id in reversed(table):
        refs[block_id] -= 1
        if refs[block_id] == 0:
            free.append(block_id)


def test_release_pushes_freed_slots_in_the_loop_order() -> None:
    rng = random.Random(7)
    kv = RadixKVCacheManager(4096, 1)
    for i in range(20):
        # Sizes on both sides of the vectorised allocate's threshold.
        assert kv.allocate(f"r{i}", rng.choice([1, 5, 47, 48, 200, 300])) is not None
    # Shared slots (ref count 2): a release must leave them held.
    kv.share("r19", kv.block_tables["r0"][:30])
    kv.share("r18", kv.block_tables["r1"][::3])
    kv.check_integrity()
    for i in rng.sample(range(20), 20):
        refs = kv._ref_counts
        free = kv.free_ids()
        table = list(kv.block_tables[f"r{i}"])
        _loop_release(refs, free, table)
        kv.free(f"r{i}")
        assert kv.free_ids() == free
        assert kv._ref_counts == refs
        kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_tree_release_pushes_freed_slots_in_node_order() -> None:
    """``release`` (evict's ``free_fn``) drops the tree's references in node order."""
    kv = RadixKVCacheManager(1024, 1)
    kv.allocate("a", 300)
    slots = list(kv.block_tables["a"])
    kv.hold(slots[100:])  # as the tree adopts them
    kv.free("a")  # the first 100 go back; the tree's stay held
    refs, free = kv._ref_counts, kv.free_ids()
    node = slots[250:] + slots[100:250][::-1]  # any order: the stack follows it
    for block_id in node:
        refs[block_id] -= 1
        free.append(block_id)
    kv.release(node)
    assert kv.free_ids() == free and kv._ref_counts == refs
    kv.check_integrity()


def test_allocate_each_on_a_radix_manager_takes_the_slots_allocate_would() -> None:
    rng = random.Random(3)
    batched, stepped = RadixKVCacheManager(2048, 1), RadixKVCacheManager(2048, 1)
    for kv in (batched, stepped):
        for i in range(80):
            kv.allocate(f"r{i}", 10 + i % 7)
    for _ in range(10):
        ids = [f"r{i}" for i in rng.sample(range(80), rng.choice([5, 60, 80]))]
        totals = [len(batched.block_tables[r]) + rng.choice([0, 1, 1, 2]) for r in ids]
        batched.allocate_each(ids, totals)
        for r, total in zip(ids, totals):
            stepped.allocate(r, total)
        assert batched.block_tables == stepped.block_tables
        assert batched.free_ids() == stepped.free_ids()
        assert batched._ref_counts == stepped._ref_counts
        batched.check_integrity()


def test_no_counts_until_the_tree_exists_then_counted_from_the_tables() -> None:
    """Before its tree every held slot has one reference (its request's): the radix manager keeps
    no counts and releases as the plain manager does, the same free stack as a counting twin;
    the first keys build the tree and the counts, one per table entry, kept from then on."""
    lazy, counted = RadixKVCacheManager(512, 1), RadixKVCacheManager(512, 1)
    counted._live_refs()
    rng = random.Random(11)
    for i in range(40):
        n = rng.choice([1, 7, 48, 90])
        assert lazy.allocate(f"r{i}", n) == counted.allocate(f"r{i}", n)
        if i % 3 == 2:
            victim = f"r{rng.randrange(i)}"
            assert lazy.free(victim) == counted.free(victim)
        assert lazy.free_ids() == counted.free_ids()
    assert lazy._refs is None and lazy.tree is None
    keys = list(range(1000, 1024))
    lazy.set_prefix_keys("k", keys)
    assert lazy.tree is not None and lazy._ref_counts == counted._ref_counts
    for rid in list(lazy.block_tables):  # counts kept: a release drops them to zero
        lazy.free(rid)
        counted.free(rid)
        assert lazy.free_ids() == counted.free_ids()
    assert lazy._ref_counts == [0] * 512
    lazy.check_integrity()


def test_share_and_hold_add_the_references_the_loop_added() -> None:
    """``share`` and ``hold`` add one reference per slot by numpy past ``_VECTOR_MIN`` ids (r50):
    the counts, the tables and the tree's tally are the per-slot loop's, on both sides of the
    threshold; a free slot among them is a ValueError naming it, however long the list."""
    import pytest

    rng = random.Random(11)
    kv = RadixKVCacheManager(8192, 1)
    for i in range(12):
        assert kv.allocate(f"r{i}", rng.choice([20, 47, 48, 49, 300, 900])) is not None
    expected = kv._ref_counts
    tables = {r: list(t) for r, t in kv.block_tables.items()}
    tree_refs = 0
    for i in range(12):
        source = tables[f"r{i}"]
        cut = rng.choice([1, 10, 47, 48, 200, len(source)])
        ids = source[:cut]
        if i % 2:
            kv.hold(ids)
            tree_refs += len(ids)
        else:
            kv.share(f"s{i}", ids)
            tables[f"s{i}"] = list(ids)
        for block_id in ids:
            expected[block_id] += 1
        assert kv._ref_counts == expected
    assert {r: list(t) for r, t in kv.block_tables.items()} == tables
    assert kv._tree_refs == tree_refs
    free = kv.free_ids()[-1]
    for n in (3, 100):  # the loop's path and numpy's
        ids = [*tables["r0"][: n - 1], free]
        with pytest.raises(ValueError, match=f"block {free} is free"):
            kv.hold(ids)


def test_typed_radix_slots_change_nothing_but_their_type(monkeypatch) -> None:
    """SGLang's radix manager keeps one-token slots in typed arrays — tables, the free stack,
    the tree's node values and its matches (``KVCacheManager.typed_slots``, r50: sharing,
    holding and releasing them then copy machine integers instead of converting lists, ~2.4x
    on the Mooncake conversation trace). The same runs with lists give the same results:
    shared prefixes under memory pressure (eviction, retraction), overlap on and off."""
    from array import array
    from dataclasses import replace

    from tailserve.kv import radix_manager
    from test_speed_paths import SHARED_PROMPTS, _assert_same, _async_fingerprint

    seen = []
    build = radix_manager.RadixKVCacheManager._build_tree

    def building(self):
        build(self)
        seen.append(self)

    monkeypatch.setattr(radix_manager.RadixKVCacheManager, "_build_tree", building)
    cases = [
        ("sglang,gpu_memory_utilization=0.25", replace(SHARED_PROMPTS, seed=5, rate=20.0)),
        ("sglang,disable_overlap_schedule=true", SHARED_PROMPTS),
    ]
    for spec, workload in cases:
        typed, _ = _async_fingerprint(spec, workload, True)
        kv = seen[-1]
        assert type(kv._free) is array and all(type(t) is array for t in kv.block_tables.values())
        assert all(type(node.value) is array for node in kv.tree._nodes() if node is not kv.tree.root)
        with monkeypatch.context() as m:
            m.setattr(radix_manager.RadixKVCacheManager, "typed_slots", False)
            listed, _ = _async_fingerprint(spec, workload, True)
            assert type(seen[-1]._free) is list
        _assert_same(typed, listed, spec)
