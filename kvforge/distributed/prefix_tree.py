"""The router's picture of what each replica has cached: one character radix tree of the
request texts sent to the replicas (SGLang's cache-aware router keeps the same), each node
marked with the replicas that were sent its text and when.

It is an approximation -- a replica's own radix tree holds tokens and evicts on its own -- so
each replica's share is capped (``max_chars``) and trimmed least recently used first.
"""
from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("text", "children", "parent", "tenants")

    def __init__(self, text: str, parent: "_Node | None") -> None:
        self.text = text
        self.children: dict[str, _Node] = {}       # first character -> child
        self.parent = parent
        self.tenants: dict[int, int] = {}          # replica -> last access (a logical clock)


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self) -> None:
        self.root = _Node("", None)
        self._clock = itertools.count(1)
        self.chars: dict[int, int] = {}            # replica -> characters it holds

    def insert(self, text: str, tenant: int) -> None:
        """Record that ``tenant`` was sent ``text`` (so holds every prefix of it)."""
        now = next(self._clock)
        node, i = self.root, 0
        node.tenants[tenant] = now
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            else:
                k = _common(child.text, text[i:])
                if k < len(child.text):
                    child = self._split(child, k)
            if tenant not in child.tenants:
                self.chars[tenant] = self.chars.get(tenant, 0) + len(child.text)
            child.tenants[tenant] = now
            node, i = child, i + len(child.text)

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after ``k`` characters; returns the new upper part."""
        upper = _Node(node.text[:k], node.parent)
        upper.tenants = dict(node.tenants)
        node.parent.children[upper.text[0]] = upper
        node.text = node.text[k:]
        node.parent = upper
        upper.children[node.text[0]] = node
        return upper

    def match(self, text: str) -> dict[int, int]:
        """For every replica holding some prefix of ``text``: the length of the longest."""
        matched: dict[int, int] = {}
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common(child.text, text[i:])
            for tenant in child.tenants:
                matched[tenant] = i + k
            if k < len(child.text):
                break
            node, i = child, i + k
        return matched

    def evict(self, tenant: int, max_chars: int) -> None:
        """Drop ``tenant``'s least recently used leaves until it holds ``max_chars`` or less."""
        if self.chars.get(tenant, 0) <= max_chars:
            return
        heap = [(n.tenants[tenant], id(n), n) for n in self._leaves(tenant)]
        heapq.heapify(heap)
        while heap and self.chars[tenant] > max_chars:
            _, _, node = heapq.heappop(heap)
            del node.tenants[tenant]
            self.chars[tenant] -= len(node.text)
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[node.text[0]]
            if parent is not self.root and tenant in parent.tenants and not any(
                    tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))

    def _leaves(self, tenant: int):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if tenant not in node.tenants:
                continue
            below = [c for c in node.children.values() if tenant in c.tenants]
            if below:
                stack.extend(below)
            else:
                yield node
