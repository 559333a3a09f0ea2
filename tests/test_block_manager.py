"""The paged-KV block manager, with no model: a shadow KV pool records what each slot holds, so
every sequence can be read back through its block table after any mix of operations."""
from __future__ import annotations

import random

import pytest

from qtk.runtime.block_manager import BlockManager
from qtk.runtime.sequence import Sequence

BS = 4


class Shadow:
    """What the runner would do: apply copies, then write each computed token's (salt, position,
    token) into its slot."""

    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.slots: list = [None] * (bm.num_blocks * bm.block_size)

    def step(self, seq: Sequence, n: int) -> bool:
        if not self.bm.allocate_slots(seq, n):
            return False
        for src, dst in self.bm.take_copies():
            bs = self.bm.block_size
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.slots[self.bm.slot(seq, pos)] = (seq.cache_salt, pos, seq.token_ids[pos])
        seq.num_computed_tokens += n
        self.bm.commit(seq)
        return True

    def check(self, seq: Sequence) -> None:
        for pos in range(seq.num_computed_tokens):
            assert self.slots[self.bm.slot(seq, pos)] == (seq.cache_salt, pos, seq.token_ids[pos]), (seq, pos)


def check_pool(bm: BlockManager, live: list[Sequence]) -> None:
    refs = [0] * bm.num_blocks
    for s in live:
        assert len(s.block_table) == len(set(s.block_table))
        for b in s.block_table:
            refs[b] += 1
    assert [b.ref_count for b in bm.blocks] == refs
    assert set(bm.free_lru) == {i for i, r in enumerate(refs) if r == 0}
    assert all(bm.blocks[b].hash == h for h, b in bm.cached.items())
    assert bm.num_free_blocks + sum(r > 0 for r in refs) == bm.num_blocks


def test_thousands_of_random_operations_keep_the_pool_balanced_and_the_kv_right():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=48, block_size=BS)
    shadow = Shadow(bm)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 14))] for _ in range(4)]
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    counts = dict(admit=0, step=0, fork=0, free=0, preempt=0, hits=0)

    def admit(seq):
        found = bm.lookup_prefix(seq)
        counts["hits"] += found > 0
        n = min(seq.num_uncomputed_tokens, rng.choice([1, 3, 8, 64]))
        if shadow.step(seq, n):
            running.append(seq)
            counts["admit"] += 1
        else:
            bm.free(seq)
            seq.reset_for_recompute()
            waiting.append(seq)

    for _ in range(4000):
        op = rng.random()
        if op < 0.2 or not running:
            if waiting and rng.random() < 0.5:
                admit(waiting.pop(0))
            else:
                prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
                admit(Sequence(prompt, block_size=BS, cache_salt=rng.choice([None, None, "tenant-b"])))
        elif op < 0.75:
            seq = rng.choice(running)
            if seq.num_uncomputed_tokens == 0:
                seq.append_token(rng.randrange(50))  # the token sampled from the last step's logits
            n = min(seq.num_uncomputed_tokens, rng.choice([1, 1, 2, 5]))
            if shadow.step(seq, n):
                counts["step"] += 1
            else:  # the pool ran dry: preempt (recompute later), never lose the request
                running.remove(seq)
                bm.free(seq)
                seq.reset_for_recompute()
                waiting.append(seq)
                counts["preempt"] += 1
        elif op < 0.85:
            parent = rng.choice(running)
            if parent.num_uncomputed_tokens == 0:
                child = Sequence(parent.token_ids, block_size=BS, cache_salt=parent.cache_salt)
                bm.fork(parent, child)
                running.append(child)
                counts["fork"] += 1
        else:
            seq = running.pop(rng.randrange(len(running)))
            bm.free(seq)
            counts["free"] += 1
        check_pool(bm, running)
        for s in running:
            shadow.check(s)
    assert min(counts.values()) > 20, counts  # every kind of operation happened, many times
    for s in running:
        bm.free(s)
    check_pool(bm, [])
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0


def test_prefix_hits_full_blocks_only_never_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=BS)
    shadow = Shadow(bm)
    a = Sequence(list(range(10)), block_size=BS)
    assert bm.lookup_prefix(a) == 0 and shadow.step(a, 10)
    assert len(bm.cached) == 2  # tokens 0..7: two full blocks
    b = Sequence(list(range(10)) + [99], block_size=BS)
    assert bm.lookup_prefix(b) == 8 and b.block_table == a.block_table[:2] and b.num_computed_tokens == 8
    c = Sequence(list(range(8)), block_size=BS)  # exactly two blocks: the last must be computed
    assert bm.lookup_prefix(c) == 4
    d = Sequence(list(range(8)) + [5], block_size=BS, cache_salt="other tenant")
    assert bm.lookup_prefix(d) == 0
    assert bm.blocks[a.block_table[0]].ref_count == 3


def test_lru_evicts_the_least_recently_freed_and_a_hit_revives_a_free_block():
    bm = BlockManager(num_blocks=4, block_size=BS)
    shadow = Shadow(bm)
    a = Sequence(list(range(9)), block_size=BS)
    bm.lookup_prefix(a)
    assert shadow.step(a, 9) and len(a.block_table) == 3
    first, second, third = a.block_table
    bm.free(a)  # tail first: of the three, the third block is the first to be reused
    assert list(bm.free_lru)[-3:] == [third, second, first]
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2  # free, but still cached
    b = Sequence(list(range(8)) + [7], block_size=BS)
    assert bm.lookup_prefix(b) == 8 and b.block_table == [first, second]
    c = Sequence([42] * 8, block_size=BS)
    bm.lookup_prefix(c)
    assert shadow.step(c, 8)  # the two remaining blocks: none of b's cached ones are evicted
    assert set(bm.cached.values()) >= {first, second}
    assert not bm.allocate_slots(Sequence([1] * 5, block_size=BS), 5)


def test_copy_on_write_of_a_shared_partial_block():
    bm = BlockManager(num_blocks=8, block_size=BS)
    shadow = Shadow(bm)
    parent = Sequence([1, 2, 3, 4, 5, 6], block_size=BS)
    bm.lookup_prefix(parent)
    shadow.step(parent, 6)
    child = Sequence(parent.token_ids, block_size=BS)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table and bm.blocks[parent.block_table[1]].ref_count == 2
    parent.append_token(7)
    child.append_token(8)
    shared = parent.block_table[1]
    assert bm.allocate_slots(child, 1)
    assert bm.copies == [(shared, child.block_table[1])] and child.block_table[0] == parent.block_table[0]
    assert bm.blocks[shared].ref_count == 1
    assert bm.allocate_slots(parent, 1) and parent.block_table[1] == shared  # the last reader writes in place
    for src, dst in bm.take_copies():
        shadow.slots[dst * BS:(dst + 1) * BS] = shadow.slots[src * BS:(src + 1) * BS]
    for seq in (parent, child):
        shadow.slots[bm.slot(seq, 6)] = (None, 6, seq.token_ids[6])
        seq.num_computed_tokens = 7
        shadow.check(seq)


def test_a_failed_allocation_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = Sequence(list(range(20)), block_size=BS)
    bm.lookup_prefix(seq)
    assert not bm.allocate_slots(seq, 20)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    assert bm.allocate_slots(seq, 12) and len(seq.block_table) == 3
    seq.num_computed_tokens = 12
    with pytest.raises(ValueError, match="go past its 20 tokens"):
        bm.allocate_slots(seq, 9)
    with pytest.raises(ValueError, match="at least one block"):
        BlockManager(0, 16)
