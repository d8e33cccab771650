"""Prefix caches over KV pages: a radix tree (page-granular) and a naive twin that caches nothing.

Contract (BasePrefixCache):
- match_prefix(ids) -> PrefixMatch: the longest cached page-aligned prefix of ids, its pages and
  a handle. The caller increfs the pages it keeps and lock()s the handle while it uses them, so
  eviction cannot take them; unlock() when done. Past the whole pages, ``copy_page`` and
  ``copy_tokens`` name a cached page whose first ``copy_tokens`` rows continue the match: the
  caller may copy those rows into a page of its own (copy-on-write; a shared page is never
  written) and start computing after them.
- insert(ids, pages): ids cover the pages, the last one possibly in part (a finished request's
  partial last page, kept as a leaf that only copy-on-write matches read). The cache takes its
  own reference on every page it adopts; for a prefix it already holds, the caller's pages are
  duplicates and stay the caller's to drop. Returns the number of tokens already cached.
- evict(num_pages): drops unlocked entries least recently used first, leaves first; returns the
  pages actually freed.
- reset(): drops every entry (after a weight update its K/V are stale); handles taken before
  stay valid to unlock. check_integrity(): raises AssertionError on corruption.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Any

from .kv_cache import PageAllocator


@dataclass
class PrefixMatch:
    pages: list[int]
    num_tokens: int
    handle: Any = None
    copy_page: int | None = None   # a cached page whose first copy_tokens rows extend the match
    copy_tokens: int = 0


class BasePrefixCache(ABC):
    def __init__(self, allocator: PageAllocator):
        self.allocator, self.page_size = allocator, allocator.page_size

    @abstractmethod
    def match_prefix(self, ids: list[int]) -> PrefixMatch: ...

    @abstractmethod
    def lock(self, handle: Any) -> None: ...

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def insert(self, ids: list[int], pages: list[int]) -> int: ...

    @abstractmethod
    def evict(self, num_pages: int) -> int: ...

    @abstractmethod
    def reset(self) -> int: ...

    @abstractmethod
    def check_integrity(self) -> None: ...

    @property
    @abstractmethod
    def num_cached_pages(self) -> int: ...


class NaivePrefixCache(BasePrefixCache):
    def match_prefix(self, ids: list[int]) -> PrefixMatch:
        return PrefixMatch([], 0, None)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert(self, ids: list[int], pages: list[int]) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def reset(self) -> int:
        return 0

    def check_integrity(self) -> None:
        pass

    @property
    def num_cached_pages(self) -> int:
        return 0


class _Children:
    """A node's children by the tokens of their first page (a partial leaf: all its tokens),
    the keys also kept sorted: the key sharing the longest prefix with a token run is next to
    the run's place in that order, so a copy-on-write match is a bisect, not a scan."""

    __slots__ = ("_by_key", "_sorted")

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, ...], _Node] = {}
        self._sorted: list[tuple[int, ...]] = []

    def __contains__(self, key: tuple[int, ...]) -> bool:
        return key in self._by_key

    def __getitem__(self, key: tuple[int, ...]) -> "_Node":
        return self._by_key[key]

    def __setitem__(self, key: tuple[int, ...], node: "_Node") -> None:
        if key not in self._by_key:
            insort(self._sorted, key)
        self._by_key[key] = node

    def __delitem__(self, key: tuple[int, ...]) -> None:
        del self._by_key[key]
        del self._sorted[bisect_left(self._sorted, key)]

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: tuple[int, ...]) -> "_Node | None":
        return self._by_key.get(key)

    def values(self):
        return self._by_key.values()

    def longest_shared(self, run: tuple[int, ...]) -> tuple["_Node | None", int]:
        """The child whose key shares the most leading tokens with ``run``, and how many."""
        at = bisect_left(self._sorted, run)
        best, shared = None, 0
        for key in self._sorted[max(at - 1, 0):at + 1]:
            k = _common_prefix(key, run)
            if k > shared:
                best, shared = self._by_key[key], k
        return best, shared

    def check(self) -> None:
        if self._sorted != sorted(self._by_key):
            raise AssertionError("a node's sorted child keys differ from its children")


@dataclass(eq=False)
class _Node:
    key: tuple[int, ...]                  # tokens of this edge: whole pages, or part of one page
                                          # (a partial leaf: read only by copy-on-write matches)
    pages: list[int]
    parent: "_Node | None"
    children: _Children = field(default_factory=_Children)
    lock_ref: int = 0
    last_access: float = field(default_factory=time.monotonic)


class RadixPrefixCache(BasePrefixCache):
    def __init__(self, allocator: PageAllocator):
        super().__init__(allocator)
        self.root = _Node((), [], None, lock_ref=1)
        self._num_pages = 0

    @property
    def num_cached_pages(self) -> int:
        return self._num_pages

    def _page_keys(self, ids: list[int]) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(ids[i:i + ps]) for i in range(0, len(ids) - len(ids) % ps, ps)]

    def _walk(self, chunks: list[tuple[int, ...]]) -> tuple[_Node, list[int], int]:
        """Descends as far as chunks match, splitting a node matched part-way.
        Returns (deepest node, its path's pages, chunks matched)."""
        node, pages, i = self.root, [], 0
        now = time.monotonic()
        while i < len(chunks) and chunks[i] in node.children:
            child = node.children[chunks[i]]
            n = len(child.pages)
            m = 1
            while m < n and i + m < len(chunks) and \
                    child.key[m * self.page_size:(m + 1) * self.page_size] == chunks[i + m]:
                m += 1
            if m < n:
                child = self._split(child, m)
            child.last_access = now
            pages += child.pages
            node, i = child, i + m
        return node, pages, i

    def _split(self, node: _Node, m: int) -> _Node:
        """node -> head (first m pages) with node as its only child; returns head."""
        cut = m * self.page_size
        head = _Node(node.key[:cut], node.pages[:m], node.parent, lock_ref=node.lock_ref,
                     last_access=node.last_access)
        node.parent.children[head.key[:self.page_size]] = head
        node.key, node.pages, node.parent = node.key[cut:], node.pages[m:], head
        head.children[node.key[:self.page_size]] = node
        return head

    def match_prefix(self, ids: list[int]) -> PrefixMatch:
        node, pages, i = self._walk(self._page_keys(ids))
        match = PrefixMatch(pages, i * self.page_size, node)
        # Past the whole pages: the child page (whole or a partial leaf) sharing the most of
        # the next tokens.
        child, shared = node.children.longest_shared(
            tuple(ids[i * self.page_size:(i + 1) * self.page_size]))
        if child is not None:
            match.copy_page, match.copy_tokens = child.pages[0], shared
            child.last_access = time.monotonic()
        return match

    def lock(self, handle: Any) -> None:
        node = handle
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: Any) -> None:
        node = handle
        while node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of an unlocked prefix-cache node")
            node.lock_ref -= 1
            node = node.parent

    def insert(self, ids: list[int], pages: list[int]) -> int:
        chunks = self._page_keys(ids)
        tail = tuple(ids[len(chunks) * self.page_size:])   # a partial last page's tokens
        if len(chunks) + bool(tail) != len(pages):
            raise ValueError(f"insert: {len(ids)} tokens fill {len(chunks)} pages"
                             f"{' and part of one' if tail else ''}, {len(pages)} pages given")
        node, _, i = self._walk(chunks)
        if i < len(chunks):
            new_pages = pages[i:len(chunks)]
            self.allocator.incref(new_pages)
            child = _Node(tuple(t for c in chunks[i:] for t in c), list(new_pages), node)
            node.children[chunks[i]] = child
            self._num_pages += len(new_pages)
            node = child
        if tail and tail not in node.children:
            self.allocator.incref(pages[-1:])
            node.children[tail] = _Node(tail, pages[-1:], node)
            self._num_pages += 1
        return i * self.page_size

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num_pages: int) -> int:
        freed = 0
        leaves = sorted((n for n in self._leaves() if n.lock_ref == 0), key=lambda n: n.last_access)
        while freed < num_pages and leaves:
            leaf = leaves.pop(0)
            freed += self.allocator.decref(leaf.pages)
            self._num_pages -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[leaf.key[:self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                leaves.append(parent)
                leaves.sort(key=lambda n: n.last_access)
        return freed

    def reset(self) -> int:
        """Drops every entry, locked or not: a locked node's pages stay alive through the
        references of the requests using them, and its handle stays valid to unlock."""
        freed, stack = 0, list(self.root.children.values())
        while stack:
            n = stack.pop()
            freed += self.allocator.decref(n.pages)
            stack.extend(n.children.values())
        self.root = _Node((), [], None, lock_ref=1)
        self._num_pages = 0
        return freed

    def check_integrity(self) -> None:
        seen: set[int] = set()
        stack = [self.root]
        total = 0
        while stack:
            n = stack.pop()
            n.children.check()
            if n is not self.root:
                partial_leaf = not n.children and len(n.pages) == 1 and \
                    0 < len(n.key) < self.page_size
                if (len(n.key) != len(n.pages) * self.page_size or not n.pages) and \
                        not partial_leaf:
                    raise AssertionError(f"node key of {len(n.key)} tokens vs {len(n.pages)} pages")
                if n.parent.children.get(n.key[:self.page_size]) is not n:
                    raise AssertionError("node not reachable under its own first page")
                if n.lock_ref < sum(c.lock_ref for c in n.children.values()):
                    raise AssertionError("a node is locked less than its children together")
            for p in n.pages:
                if p in seen or self.allocator.ref[p] < 1:
                    raise AssertionError(f"page {p} shared by two nodes or not referenced")
                seen.add(p)
            total += len(n.pages)
            stack.extend(n.children.values())
        if total != self._num_pages:
            raise AssertionError(f"page count {self._num_pages} != {total} pages in the tree")


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


PREFIX_CACHES = {"radix": RadixPrefixCache, "naive": NaivePrefixCache}


def create_prefix_cache(name: str, allocator: PageAllocator) -> BasePrefixCache:
    if name not in PREFIX_CACHES:
        raise ValueError(f"unknown prefix cache {name!r}; choose from {sorted(PREFIX_CACHES)}")
    return PREFIX_CACHES[name](allocator)
