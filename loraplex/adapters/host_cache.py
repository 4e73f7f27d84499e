"""Host memory (CPU) tier of the adapters: an LRU cache of loaded adapters and the thread that loads them
from disk. The scheduler never waits for a load (S-LoRA / vLLM style): a request whose adapter is not here
is skipped while the load runs, and the engine thread takes finished loads in at each step (`poll`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from loraplex.adapters.peft import LoRAAdapter
from loraplex.adapters.stats import TierStats

logger = logging.getLogger(__name__)

# load(name) -> (adapter, seconds), run on the load thread
Loader = Callable[[str], tuple[LoRAAdapter, float]]


def _one_torch_thread() -> None:
    """Initializer of the load thread: its torch ops run on one core.

    The loads' stacking and checks are large enough for torch to split them over every core, and an
    OpenMP team in this thread next to the engine's oversubscribes the CPU (docs/kernels.md, paging).
    `torch.set_num_threads` sets the calling thread's count but also the default that threads take on
    their first torch op; the constructing thread puts that default back at once (`HostCache`).
    """
    torch.get_num_threads()  # this thread's first torch call: it takes the default now, not later
    torch.set_num_threads(1)


class HostCache:
    """At most `capacity` loaded adapters (None: no bound), least recently used first in `entries`;
    `loading` the loads in flight, each with the registration epoch it was started for; `failed` the
    adapters whose load failed, with the reason, until `forget_failure`."""

    def __init__(self, capacity: int | None, load: Loader):
        self.capacity = capacity
        self._load = load
        self.entries: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loading: dict[str, tuple[Future, int]] = {}
        self.failed: dict[str, str] = {}
        self.stats = TierStats()
        default_threads = torch.get_num_threads()  # this thread's count (set before the loader starts)
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-adapter-load",
                                          initializer=_one_torch_thread)
        self._loader.submit(int).result()  # start it now ...
        torch.set_num_threads(default_threads)  # ... and restore the default for threads started later

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> LoRAAdapter:
        return self.entries[name]

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, name: str) -> None:
        """`name` was used: it is the most recently used now."""
        self.stats.hits += 1
        self.entries.move_to_end(name)

    def prefetch(self, name: str, epoch: int, evictable: Callable[[str], bool],
                 keep: Collection[str] = frozenset()) -> bool:
        """Start loading `name` (registration `epoch`) if it is not here; True once it is.

        Makes room by evicting the least recently used entry that `evictable` allows (no request pins it)
        and that is not in `keep` (adapters that earlier waiting requests want); if none, does nothing.
        """
        if name in self.entries:
            return True
        if name in self.loading or name in self.failed:
            return False
        if self.capacity is not None and len(self.entries) + len(self.loading) >= self.capacity:
            victim = next((n for n in self.entries if evictable(n) and n not in keep), None)
            if victim is None:
                return False
            del self.entries[victim]
            self.stats.evictions += 1
        self.stats.misses += 1
        self.loading[name] = (self._loader.submit(self._load, name), epoch)
        return False

    def poll(self, epoch_of: Callable[[str], int | None]) -> tuple[list[str], list[str]]:
        """Take in finished loads (engine thread): a load whose adapter was unregistered (and maybe
        registered again) since it started, `epoch_of(name)` differing, is dropped. Returns the adapters
        loaded and those whose load failed, in this call."""
        loaded, failed = [], []
        for name, (future, epoch) in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[name]
            if epoch_of(name) != epoch or future.cancelled():
                continue
            try:
                adapter, seconds = future.result()
            except Exception as exc:  # files changed or vanished since registration
                logger.error("loading adapter %r failed: %s", name, exc)
                self.failed[name] = str(exc)
                failed.append(name)
                continue
            self.stats.load_s.append(seconds)
            self.entries[name] = adapter
            loaded.append(name)
        return loaded, failed

    def wait(self, timeout: float) -> None:
        """Sleep until a load in flight ends, at most `timeout` seconds; at once if none is."""
        if self.loading:
            wait([f for f, _ in self.loading.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def drop(self, name: str) -> None:
        """Forget `name`: its entry, a load in flight (cancelled) and a failure."""
        self.entries.pop(name, None)
        future = self.loading.pop(name, None)
        if future is not None:
            future[0].cancel()
        self.failed.pop(name, None)

    def forget_failure(self, name: str) -> None:
        self.failed.pop(name, None)

    def run_on_loader(self, fn: Callable, *args):
        """`fn(*args)` on the load thread, its result (tests and benchmarks)."""
        return self._loader.submit(fn, *args).result()

    def close(self) -> None:
        self._loader.shutdown(wait=False, cancel_futures=True)
