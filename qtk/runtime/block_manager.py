"""Paged KV cache bookkeeping: fixed-size blocks in one pool, a block table per sequence,
ref-counted sharing, prefix caching and copy-on-write.

    pool        num_blocks blocks of block_size token slots each (the runner owns the tensors;
                this class owns which block holds what)
    free        blocks with no reader, in LRU order: a freed block goes to the back, a new block
                is taken from the front; a free block keeps its cached content until it is taken
    prefix      a full block's hash chains its parent's hash, its token ids and the request's
                cache_salt (tenants with different salts never share): SHA-256 from a random root
                per pool, as vLLM's, so no request can craft a collision with another's prefix
                (Python's hash() could be); a new request takes the longest run of its full prompt
                blocks found in the cache, without recomputing them
    fork        a child shares its parent's blocks (ref_count + 1 each); the first write into a
                shared, partly filled block copies it first (copy-on-write: the (src, dst) pairs
                wait in take_copies() for the runner to apply before its next forward)

The scheduler calls lookup_prefix at admission, allocate_slots before each step with the tokens
the step computes, commit after the step (and trim where it rejected drafts), free when a sequence
finishes, aborts or is preempted.
"""
from __future__ import annotations

import hashlib
import math
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while the block is in the prefix cache
    parent: bytes | None = None  # the hash it chains (to verify a hit, not just the hash)
    tokens: tuple[int, ...] = ()


def block_hash(parent: bytes, tokens: tuple[int, ...], salt: str | None) -> bytes:
    """SHA-256 of (parent hash, salt, token ids); the first block's parent is the pool's root."""
    h = hashlib.sha256(parent)
    if salt is not None:
        encoded = salt.encode()
        h.update(len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"the KV pool needs at least one block of at least one slot, got {num_blocks} x {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # free blocks, LRU first
        self.root = os.urandom(32)  # the parent of every first block: hashes differ from pool to pool
        self.cached: dict[bytes, int] = {}  # prefix hash -> block id
        self.copies: list[tuple[int, int]] = []  # (src, dst) block copies for the runner
        self.prefix_queries = 0  # tokens of admitted sequences looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    # -- pool ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_lru)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences (cached free blocks count as free)."""
        return 1 - len(self.free_lru) / len(self.blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _allocate(self) -> int:
        block_id, _ = self.free_lru.popitem(last=False)  # the least recently freed block
        b = self.blocks[block_id]
        if b.hash is not None:  # evict its cached content
            if self.cached.get(b.hash) == block_id:
                del self.cached[b.hash]
            b.hash, b.parent, b.tokens = None, None, ()
        b.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count == 0:
            del self.free_lru[block_id]
        b.ref_count += 1

    def _release(self, block_id: int) -> None:
        b = self.blocks[block_id]
        b.ref_count -= 1
        if b.ref_count == 0:
            self.free_lru[block_id] = None  # the back: most recently used, evicted last

    # -- sequences -------------------------------------------------------------------------
    def lookup_prefix(self, seq: Sequence) -> int:
        """At admission: give seq the cached blocks of its longest cached run of full blocks (never
        its last token, whose logits the step must compute); returns the tokens found. The
        scheduler counts the lookup (count_lookup) once the admission holds."""
        if seq.block_table:
            raise RuntimeError(f"lookup_prefix on {seq}, which already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        parent = self.root
        for i in range((len(seq) - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i))
            h = block_hash(parent, tokens, seq.cache_salt)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].tokens != tokens or self.blocks[block_id].parent != parent:
                break
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        found = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens = found
        return found

    def count_lookup(self, queried: int, found: int) -> None:
        """An admitted sequence's lookup: `queried` tokens, `found` of them cached (the metrics)."""
        self.prefix_queries += queried
        self.prefix_hits += found

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Slots for seq's next num_new_tokens tokens (after its computed ones); False, changing
        nothing, when the pool cannot give them. A shared, partly filled block about to be written
        is copied first."""
        end = seq.num_computed_tokens + num_new_tokens
        if end > len(seq) + len(seq.spec_token_ids):
            raise ValueError(f"{seq}: {num_new_tokens} new tokens go past its {len(seq)} tokens "
                             f"and {len(seq.spec_token_ids)} drafts")
        new = self.blocks_for(end) - len(seq.block_table)
        first = seq.num_computed_tokens // self.block_size  # the block the first new token goes to
        cow = num_new_tokens > 0 and first < len(seq.block_table) and self.blocks[seq.block_table[first]].ref_count > 1
        if max(new, 0) + cow > len(self.free_lru):
            return False
        if cow:
            shared = seq.block_table[first]
            seq.block_table[first] = self._allocate()
            self.copies.append((shared, seq.block_table[first]))
            self._release(shared)
        for _ in range(new):
            seq.block_table.append(self._allocate())
        return True

    def commit(self, seq: Sequence) -> None:
        """After a step: enter seq's blocks that are now full (every token computed) in the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else self.root
            tokens = tuple(seq.block_tokens(i))
            h = block_hash(parent, tokens, seq.cache_salt)
            seq.block_hashes.append(h)
            b = self.blocks[seq.block_table[i]]
            if self.enable_prefix_caching and b.hash is None and h not in self.cached:
                b.hash, b.parent, b.tokens = h, parent, tokens
                self.cached[h] = b.block_id

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past seq's tokens (those that held only rejected drafts' KV)."""
        keep = self.blocks_for(len(seq))
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """child (same tokens so far) shares all of parent's blocks."""
        if child.block_table:
            raise RuntimeError(f"fork into {child}, which already holds blocks")
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens

    def free(self, seq: Sequence) -> None:
        """Give back seq's blocks (tail first, so a prefix outlives its tails in the LRU order)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        freed = {b for b in seq.block_table if self.blocks[b].ref_count == 0}
        self.copies = [(src, dst) for src, dst in self.copies if dst not in freed]
        seq.block_table = []
        seq.block_hashes = []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.copies = self.copies, []
        return copies

    def slot(self, seq: Sequence, position: int) -> int:
        """The pool slot (block_id * block_size + offset) of seq's token at `position`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
