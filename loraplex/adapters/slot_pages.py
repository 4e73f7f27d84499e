"""The page allocator of the adapter slot tier: which adapter holds which rank rows. Pure bookkeeping, no
tensors (the slot buffers are `slot_buffers.SlotBuffers`), so every policy here has fast unit tests.

Letters: S adapter slots (`max_loras`), R max rank (`max_lora_rank`), P pages per slot, V = S x P pages.

The slot tier is paged by rank (S-LoRA's unified paging, arXiv:2311.03285): its S x R rank rows are cut
into pages of `page` rows. An adapter of rank r takes a run of ceil(r / page) pages rounded up to a
power of two, aligned to its length inside one physical slot: a buddy allocator's blocks, so any run can
be freed by evicting the adapters inside it or the one around it and fragmentation stays bounded. Its
first page is its virtual slot, the id the kernels take.

    physical slot 0            physical slot 1          (P = 8 pages of 8 rows: R = 64)
    | a | b | c c | d d d d |  | e e e e e e e e |       a, b rank 8; c rank 16; d rank 32; e rank 64
      0   1   2     4          8                          virtual slots: a 0, b 1, c 2, d 4, e 8

A free run is taken first (buddy best fit), else one whose owners are all unpinned, least recently used
first. No starvation (after LoRAX's adapter exchange): when the oldest waiting adapter cannot get pages
because every run it could take holds a pinned adapter, the run whose owners got their pages earliest is
reserved for it (`make_room_for`): no other adapter takes pages there, and its owners *drain*: they admit
no new requests, and once their running requests end the run goes to the waiting adapter.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict


class SlotPages:
    """Pages of `num_slots` slots of `max_rank` rank rows, `page` rows each (a divisor of max_rank).

    `slot_of[name]` is a resident adapter's virtual slot (least recently used first), `slot_ranks`
    (length V) the rank at each virtual slot (0 elsewhere), `owner` (length V) the adapter holding each
    page, `refcount` the pins (running requests) of each adapter, `reserved` (adapter, first page, end
    page) or None, `draining` the owners of the reserved run.
    """

    def __init__(self, num_slots: int, max_rank: int, page: int):
        if max_rank % page:
            raise ValueError(f"page ({page} rows) must divide max_rank ({max_rank})")
        self.page = page
        self.pages_per_slot = max_rank // page  # P
        self.num_pages = num_slots * self.pages_per_slot  # V, also the number of virtual slots
        self.slot_of: OrderedDict[str, int] = OrderedDict()
        self.slot_since: dict[str, int] = {}  # when each resident adapter got its pages (tick)
        self.owner: list[str | None] = [None] * self.num_pages
        self.slot_ranks = [0] * self.num_pages
        self.refcount: dict[str, int] = {}
        self.draining: set[str] = set()
        self.reserved: tuple[str, int, int] | None = None
        self._run_cache: dict[tuple[int, bool], int | None] = {}  # _choose_run's answers until state changes
        self._ticks = itertools.count()

    def __contains__(self, name: str) -> bool:
        return name in self.slot_of

    @property
    def num_used_pages(self) -> int:
        return sum(o is not None for o in self.owner)

    # pins ---------------------------------------------------------------------------------------------
    def pin(self, name: str) -> int:
        """One more use of resident `name` (most recently used now); returns its virtual slot."""
        self.slot_of.move_to_end(name)
        self.refcount[name] = self.refcount.get(name, 0) + 1
        self._run_cache.clear()
        return self.slot_of[name]

    def unpin(self, name: str) -> None:
        self.refcount[name] -= 1
        if not self.refcount[name]:
            del self.refcount[name]
            self._run_cache.clear()

    def is_pinned(self, name: str) -> bool:
        return bool(self.refcount.get(name))

    # runs of pages --------------------------------------------------------------------------------------
    def pages_for(self, rank: int) -> int:
        """Pages of the run an adapter of `rank` takes: ceil(rank / page) rounded up to a power of two, at
        most a physical slot's P pages."""
        n = max(1, -(-rank // self.page))
        return min(1 << (n - 1).bit_length(), self.pages_per_slot)

    def _runs(self, n: int) -> list[int]:
        """First pages of every run of `n` pages: aligned to n inside each physical slot."""
        p = self.pages_per_slot
        return [s + k for s in range(0, self.num_pages, p) for k in range(0, p - n + 1, n)]

    def owners(self, start: int, n: int) -> list[str]:
        """Adapters owning pages start .. start + n - 1, each once, in page order."""
        return [o for o in dict.fromkeys(self.owner[start:start + n]) if o is not None]

    def find_run(self, name: str, rank: int) -> int | None:
        """First page of the run `name` of `rank` would take now, or None if there is none.

        A free run first, the one whose largest free aligned block around it is smallest (a buddy
        allocator's best fit, which keeps large blocks whole for large ranks); otherwise a run whose owners
        are all unpinned, to evict: draining owners first, then the run whose most recently used owner is
        least recent, then the fewest owners. Pages reserved for another adapter are never taken.
        """
        n = self.pages_for(rank)
        holder = self.reserved is not None and self.reserved[0] == name
        if (n, holder) not in self._run_cache:
            self._run_cache[n, holder] = self._choose_run(n, holder)
        return self._run_cache[n, holder]

    def _choose_run(self, n: int, holder: bool) -> int | None:
        kept = set() if holder or self.reserved is None else set(range(*self.reserved[1:]))
        usable = [s for s in self._runs(n) if kept.isdisjoint(range(s, s + n))]
        free = [s for s in usable if not self.owners(s, n)]
        if free:
            return min(free, key=lambda s: (self._free_block(s, n, kept), s))
        lru = {a: i for i, a in enumerate(self.slot_of)}
        candidates = []
        for s in usable:
            owners = self.owners(s, n)
            if not any(self.refcount.get(o) for o in owners):
                recent = max(lru[o] for o in owners)
                candidates.append((not self.draining.issuperset(owners), recent, len(owners), s))
        return min(candidates)[-1] if candidates else None

    def _free_block(self, start: int, n: int, kept: set[int]) -> int:
        """Pages of the largest free aligned block (n, 2n, 4n, ... pages) inside one physical slot that holds
        the free run start .. start + n - 1."""
        base, p = start - start % self.pages_per_slot, self.pages_per_slot
        while 2 * n <= p:
            block = base + (start - base) // (2 * n) * (2 * n)
            pages = range(block, block + 2 * n)
            if pages.stop > base + p or self.owners(block, 2 * n) or not kept.isdisjoint(pages):
                break
            n *= 2
        return n

    def take(self, name: str, rank: int) -> tuple[int, list[tuple[str, int]]]:
        """Give `name` (not resident) of `rank` the run `find_run` picks, evicting its owners. Returns its
        virtual slot and the evicted adapters with the virtual slot each had (their rows are the caller's
        to zero). A reservation held for `name` ends. RuntimeError when no run is free or evictable."""
        start = self.find_run(name, rank)
        if start is None:
            raise RuntimeError(f"no free or evictable pages for adapter {name!r}")
        n = self.pages_for(rank)
        evicted = [(owner, self.evict(owner)) for owner in self.owners(start, n)]
        self.owner[start:start + n] = [name] * n
        self.slot_of[name] = start
        self.slot_since[name] = next(self._ticks)
        self.slot_ranks[start] = rank
        if self.reserved is not None and self.reserved[0] == name:
            self.reserve(None)
        self._run_cache.clear()
        return start, evicted

    def evict(self, name: str) -> int:
        """Free resident, unpinned `name`'s pages; returns the virtual slot it had."""
        assert not self.refcount.get(name), f"evicting pinned adapter {name!r}"
        slot = self.slot_of.pop(name)
        n = self.pages_for(self.slot_ranks[slot])
        self.owner[slot:slot + n] = [None] * n
        self.slot_ranks[slot] = 0
        del self.slot_since[name]
        self.draining.discard(name)
        self._run_cache.clear()
        return slot

    # the reservation ------------------------------------------------------------------------------------
    def reserve(self, name: str | None = None, start: int = 0, n: int = 0) -> None:
        """Keep pages start .. start + n - 1 for `name` and drain their owners; no arguments: end it."""
        self.reserved = None if name is None else (name, start, start + n)
        self.draining = set(self.owners(start, n))
        self._run_cache.clear()

    def make_room_for(self, name: str | None, rank: int | None) -> None:
        """`name` is the adapter of the oldest request that waits for pages (None: no such request), of
        `rank` (None: not in host memory yet, so nothing is drained for it).

        If pinned adapters hold pages of every run `name` could take, reserve for it the run whose owners
        got their pages earliest (`slot_since`) and drain those owners; the reservation moves when another
        adapter becomes the oldest waiting one and ends when `name` takes its pages or nobody waits.
        """
        if name is None or (self.reserved is not None and self.reserved[0] != name):
            self.reserve(None)
        if name is None or rank is None or self.reserved is not None or name in self.slot_of:
            return
        if self.find_run(name, rank) is not None:
            return
        n = self.pages_for(rank)

        def age(s: int):
            owners = self.owners(s, n)
            return max((self.slot_since[o] for o in owners), default=-1), len(owners), s

        self.reserve(name, min(self._runs(n), key=age), n)
