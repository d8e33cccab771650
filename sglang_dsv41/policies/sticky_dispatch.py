"""Session-sticky DP dispatch keyed by ``routing_key``, for users without a router.

Every turn of a session lands on the DP rank that holds its prefix cache. A new key goes to the
active rank with the fewest in-flight requests (when loads are known), then the fewest pinned
keys; a key whose rank left the active set is placed again (its prefix is recomputed there).
The table is bounded: the least recently used key is forgotten first.
"""

from __future__ import annotations

from collections import Counter, OrderedDict


class StickyDispatch:
    def __init__(self, max_keys: int = 1 << 20):
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._pins: OrderedDict[str, int] = OrderedDict()
        self._keys_per_rank: Counter[int] = Counter()

    def rank_for(self, key: str, active: list[int], loads: list[int] | None = None) -> int:
        if not active:
            raise RuntimeError("no active DP rank to dispatch to")
        rank = self._pins.get(key)
        if rank is not None and rank in active:
            self._pins.move_to_end(key)
            return rank
        if rank is not None:
            self._forget(key)

        def cost(r: int) -> tuple[int, int, int]:
            load = loads[r] if loads is not None and r < len(loads) else 0
            return load, self._keys_per_rank[r], r

        rank = min(active, key=cost)
        self._pins[key] = rank
        self._keys_per_rank[rank] += 1
        while len(self._pins) > self.max_keys:
            self._forget(next(iter(self._pins)))
        return rank

    def _forget(self, key: str) -> None:
        self._keys_per_rank[self._pins.pop(key)] -= 1

    def pinned(self, key: str) -> int | None:
        return self._pins.get(key)
