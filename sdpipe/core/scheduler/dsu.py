"""The disjoint sets of a stage's workers that the groups since the last reset have connected."""

from __future__ import annotations

from typing import Iterable

__all__ = ["DisjointSet"]


class DisjointSet:
    """Union-find over worker ids; ``count`` is the number of components among its items."""

    def __init__(self, items: Iterable[int] = ()):
        self.parent = {i: i for i in items}
        self.count = len(self.parent)

    def find(self, x: int) -> int:
        if x not in self.parent:
            self.parent[x] = x
            self.count += 1
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, members: Iterable[int]) -> None:
        members = members if isinstance(members, (list, tuple)) else list(members)
        if not members:
            return
        find, a = self.find, self.find(members[0])  # stays the root: the others' roots go under it
        for m in members[1:]:
            b = find(m)
            if a != b:
                self.parent[b] = a
                self.count -= 1

    def merges(self, members: Iterable[int]) -> int:
        """How many components ``union(members)`` would join away (without changing anything)."""
        roots = {self.find(m) for m in members}
        return max(0, len(roots) - 1)

    def connects(self, items: Iterable[int]) -> bool:
        roots = {self.find(i) for i in items}
        return len(roots) <= 1

    def copy(self) -> "DisjointSet":
        d = DisjointSet()
        d.parent = dict(self.parent)
        d.count = self.count
        return d
