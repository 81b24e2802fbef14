"""Which data-parallel replica serves a request: SGLang's cache-aware policy.

    loads imbalanced (max - min > balance_abs and max > balance_rel x min)
        -> the least loaded replica (the cache cannot win back a long queue)
    else the replica holding the longest prefix of the request's text, if that prefix is more
        than cache_threshold of the text
    else the least loaded replica (ties: the one holding the least text, most room to cache)

Load is the number of requests a replica is serving now (sent, not yet finished). Every
routed text is recorded in the ``PrefixTree`` under the replica it went to. A replica marked
down (unreachable) is left out until marked up again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvforge.distributed.prefix_tree import PrefixTree


@dataclass(frozen=True)
class RouterConfig:
    cache_threshold: float = 0.5         # SGLang's defaults
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_tree_chars: int = 2**22          # per replica, then least recently used text goes

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance thresholds must be >= 0 and >= 1, got "
                             f"{self.balance_abs_threshold}, {self.balance_rel_threshold}")
        if self.max_tree_chars <= 0:
            raise ValueError(f"max_tree_chars must be > 0, got {self.max_tree_chars}")


class CacheAwareRouter:
    def __init__(self, num_replicas: int, config: RouterConfig | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.num_replicas = num_replicas
        self.config = config or RouterConfig()
        self.tree = PrefixTree()
        self.loads = [0] * num_replicas
        self.down: set[int] = set()         # unreachable replicas: routed around

    def mark_down(self, replica: int) -> None:
        self.down.add(replica)

    def mark_up(self, replica: int) -> None:
        self.down.discard(replica)

    def route(self, text: str) -> tuple[int, str]:
        """(replica, why: 'cache' | 'balance' | 'load') for a request about to be sent; the
        caller calls ``finished(replica)`` when it is done. RuntimeError when every replica
        is down."""
        c = self.config
        live = [r for r in range(self.num_replicas) if r not in self.down]
        if not live:
            raise RuntimeError(f"all {self.num_replicas} replicas are unreachable")
        hi, lo = max(self.loads[r] for r in live), min(self.loads[r] for r in live)
        if hi - lo > c.balance_abs_threshold and hi > lo * c.balance_rel_threshold:
            replica, why = self._least_loaded(live), "balance"
        else:
            matched = {r: n for r, n in self.tree.match(text).items() if r not in self.down}
            best = max(matched.items(), key=lambda kv: (kv[1], -self.loads[kv[0]]), default=None)
            if best is not None and text and best[1] / len(text) > c.cache_threshold:
                replica, why = best[0], "cache"
            else:
                replica, why = self._least_loaded(live), "load"
        self.tree.insert(text, replica)
        self.tree.evict(replica, c.max_tree_chars)
        self.loads[replica] += 1
        return replica, why

    def finished(self, replica: int) -> None:
        self.loads[replica] -= 1

    def _least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda r: (self.loads[r], self.tree.chars.get(r, 0), r))


def routing_text(path: str, body: dict[str, Any]) -> str:
    """The text whose prefixes the replicas cache: the prompt, or the chat messages in order
    (one JSON object each, so a conversation's earlier turns are a prefix of its later ones)."""
    if path.endswith("/chat/completions"):
        return "".join(json.dumps(m, sort_keys=True, ensure_ascii=False)
                       for m in body.get("messages") or [])
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return " ".join(map(str, prompt))            # token ids
        return json.dumps(prompt)                         # a batch: routed as one
    return str(prompt)
