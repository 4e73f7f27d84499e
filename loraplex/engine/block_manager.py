"""KV cache block allocator, per-request block tables and the prefix cache.

A request's token at position p lives in slot `block_table[p // block_size] * block_size + p % block_size`
of every layer's K and V cache ([num_blocks * block_size, nKV, D]):

    block_size = 4, block_table = [7, 2]
    positions  0  1  2  3 | 4  5
    slots     28 29 30 31 | 8  9

Blocks are granted in whole and given back the step a request finishes, is aborted or is preempted.

Prefix caching (vLLM's automatic prefix caching, with the adapter's weights in the key): once a block
is full and its K/V are computed, it is registered under a key chained over the blocks before it,

    key[-1] = sha256("loraplex-kv" | identity | scope)   identity: "base", or the adapter's content digest
    key[i]  = sha256(key[i-1] | tokens of block i)       scope: the request's tenant, or "" (global)

so a key names the block's tokens, every token before them and the weights their K/V came from. LoRA
changes K and V, so blocks computed under one adapter never serve another or the base model; the
identity is the adapter's files' digest, not its name, so an adapter uploaded again under the same name
with new weights never meets the old blocks (vLLM keyed by name and served stale K/V, vllm#42125).
sha256 keys make a collision as unlikely as a digest's (vLLM's `prefix_caching_hash_algo="sha256"`).

Scope "tenant" (the default) shares blocks only among one tenant's requests: a shared cache would let a
tenant learn from its `cached_tokens`, or from its time to first token, that another tenant sent a prompt
(the side channel vLLM's per-request `cache_salt` closes). Scope "global" shares across tenants.

A block is shared by reference count. When the count drops to zero a registered block keeps its K/V
and key and joins an LRU of evictable blocks; a new request whose prompt starts with those tokens takes
it back (`computed_blocks`, `allocate`). Fresh blocks come from the free pool first and from the LRU's
oldest end only when the pool is empty; a request's blocks enter the LRU last block first, so a cached
prefix loses its tail before its head. Partial blocks are never registered, and a block computed twice
(two requests filling the same key at once) is registered once; the copy stays private.

Invariant (`check`): every block is in exactly one of: the free pool, the LRU (count 0, registered),
or some block tables (count = the number of tables holding it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

from loraplex.engine.config import PREFIX_CACHE_SCOPES
from loraplex.engine.request import Request

BASE_IDENTITY = "base"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_identity_of(req: Request) -> str:
    """The weights `req`'s K/V depend on: the engine sets `Request.kv_identity` ("base" or the adapter's
    content digest); a request built without one (scheduler tests) is keyed by its adapter's name."""
    if req.kv_identity is not None:
        return req.kv_identity
    return BASE_IDENTITY if req.adapter is None else f"name:{req.adapter}"


class BlockManager:
    """KV cache blocks: a free pool, reference counts and, with `enable_prefix_caching`, the cache of
    full blocks by key, shared within `scope` ("tenant" or "global"). Says no by returning False, never by
    raising.

    num_cached_query_tokens / num_cached_hit_tokens: tokens of the requests admitted since start (prompt
    and, after a preemption, output) and the tokens of them found cached (vLLM's prefix cache queries
    and hits). num_evicted_blocks: cached blocks taken for other tokens since start."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 scope: str = "tenant"):
        if scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"prefix cache scope must be one of {PREFIX_CACHE_SCOPES}, got {scope!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.scope = scope
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # hold nothing anyone may look up
        self.evictable: OrderedDict[int, None] = OrderedDict()  # count 0, registered; oldest first
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key -> the block registered under it
        self.num_cached_query_tokens = 0
        self.num_cached_hit_tokens = 0
        self.num_evicted_blocks = 0  # cached blocks reused for other tokens since start

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: the free pool and the evictable cached blocks."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Registered blocks, in use or evictable."""
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, 0..1 (evictable cached blocks count as free, as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Blocks to add so that `req` can hold `num_computed_tokens + num_new_tokens` tokens."""
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(req.block_table))

    # prefix cache -----------------------------------------------------------------------------------
    def block_key(self, req: Request, i: int) -> bytes:
        """Key of `req`'s block i (its tokens must be known), computed once per request and kept there."""
        keys, bs = req.block_keys, self.block_size
        while len(keys) <= i:
            j = len(keys)
            parent = keys[j - 1] if j else self._root_key(req)
            tokens = array("q", req.token_ids_between(j * bs, (j + 1) * bs)).tobytes()
            keys.append(hashlib.sha256(parent + tokens).digest())
        return keys[i]

    def _root_key(self, req: Request) -> bytes:
        scope = f"tenant:{req.tenant_id}" if self.scope == "tenant" else ""
        return hashlib.sha256(f"loraplex-kv\0{kv_identity_of(req)}\0{scope}".encode()).digest()

    def computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks that starts `req`'s tokens, for a request with nothing computed.
        At most (num_tokens - 1) // block_size blocks, so at least its last token is computed again (its
        logits are needed): a prompt cached whole recomputes its last full block, as in vLLM."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        for i in range((req.num_tokens - 1) // self.block_size):
            block = self.cached.get(self.block_key(req, i))
            if block is None:
                break
            hit.append(block)
        return hit

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks of `req` that are full of computed tokens and not registered yet (after
        each forward pass that computed some). A key already registered keeps its block."""
        if not self.enable_prefix_caching:
            return
        for i in range(req.num_registered_blocks, req.num_computed_tokens // self.block_size):
            key, block = self.block_key(req, i), req.block_table[i]
            if key not in self.cached and self.block_keys[block] is None:
                self.cached[key] = block
                self.block_keys[block] = key
            req.num_registered_blocks = i + 1

    # the allocator's verbs ----------------------------------------------------------------------------
    def allocate(self, req: Request, num_new_tokens: int, cached: Sequence[int] = ()) -> bool:
        """Grow `req.block_table` for `num_new_tokens` more tokens; False (nothing taken) if short.
        cached: for a request with no blocks yet, the blocks of its cached prefix (`computed_blocks`),
        taken first; its new tokens start after them (the caller sets `num_computed_tokens`)."""
        if cached:
            assert not req.block_table, "a cached prefix is taken only by a request with no blocks"
            n = cdiv(len(cached) * self.block_size + num_new_tokens, self.block_size) - len(cached)
            reclaimed = sum(1 for b in cached if not self.ref_counts[b])  # leave the LRU, not free any more
            if n + reclaimed > self.num_free_blocks:
                return False
            for b in cached:
                if not self.ref_counts[b]:
                    del self.evictable[b]
                self.ref_counts[b] += 1
            req.block_table = list(cached)
            req.num_registered_blocks = len(cached)
        else:
            n = self.num_blocks_needed(req, num_new_tokens)
            if n > self.num_free_blocks:
                return False
        for _ in range(n):
            block = self._take_fresh()
            self.ref_counts[block] = 1
            req.block_table.append(block)
        return True

    def _take_fresh(self) -> int:
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        block, _ = self.evictable.popitem(last=False)  # the least recently used cached block
        del self.cached[self.block_keys[block]]
        self.block_keys[block] = None
        self.num_evicted_blocks += 1
        return block

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (`num_cached_query_tokens`, `num_cached_hit_tokens`)."""
        if self.enable_prefix_caching:
            self.num_cached_query_tokens += num_tokens
            self.num_cached_hit_tokens += num_hit_tokens

    def free(self, req: Request) -> None:
        """Give back `req`'s blocks: a block no other request holds goes to the LRU if registered, else to
        the free pool (last block first, so a cached prefix is evicted from its tail)."""
        for block in reversed(req.block_table):
            self.ref_counts[block] -= 1
            if not self.ref_counts[block]:
                if self.block_keys[block] is None:
                    self.free_block_ids.append(block)
                else:
                    self.evictable[block] = None
        req.block_table = []
        req.num_registered_blocks = 0

    def slot(self, req: Request, position: int) -> int:
        """KV cache slot of `req`'s token at `position`."""
        return req.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def check(self, tables: Sequence[list[int]] = ()) -> None:
        """Assert the invariant of the module's docstring, given every block table in use (tests; O(blocks))."""
        held = [0] * self.num_blocks
        for table in tables:
            for b in table:
                held[b] += 1
        assert held == self.ref_counts, "reference counts differ from the block tables holding the blocks"
        free, lru = set(self.free_block_ids), set(self.evictable)
        assert len(free) == len(self.free_block_ids) and not free & lru, "a block is free twice"
        for b in range(self.num_blocks):
            in_use = held[b] > 0
            assert in_use + (b in free) + (b in lru) == 1, f"block {b} is in no pool or in two"
            assert (b in lru) <= (self.block_keys[b] is not None), f"evictable block {b} has no key"
            assert b not in free or self.block_keys[b] is None, f"free block {b} still has a key"
        assert all(self.block_keys[b] == k for k, b in self.cached.items()), "cache and block keys disagree"
        assert sum(k is not None for k in self.block_keys) == len(self.cached), "a key is not in the cache"
