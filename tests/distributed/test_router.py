"""The cache-aware routing policy and the prefix tree behind it, without servers."""
from __future__ import annotations

import random

import pytest

from kvforge.distributed.prefix_tree import PrefixTree
from kvforge.distributed.router import CacheAwareRouter, RouterConfig, routing_text


def test_tree_matches_longest_prefix_per_replica():
    tree = PrefixTree()
    tree.insert("the cat sat on the mat", 0)
    tree.insert("the cat ran", 1)
    tree.insert("the dog", 1)
    assert tree.match("the cat sat here") == {0: 12, 1: 8}
    assert tree.match("the dog barked") == {0: 4, 1: 7}
    assert tree.match("a bird") == {}
    assert tree.chars == {0: len("the cat sat on the mat"), 1: len("the cat ran") + len("dog")}


def test_tree_agrees_with_brute_force():
    rng = random.Random(0)
    tree, sent = PrefixTree(), {0: [], 1: [], 2: []}
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 12)))
        tenant = rng.randrange(3)
        tree.insert(text, tenant)
        sent[tenant].append(text)
        query = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 12)))
        expected = {}
        for t, texts in sent.items():
            best = max((len(_common(query, s)) for s in texts), default=0)
            if best:
                expected[t] = best
        assert tree.match(query) == expected


def _common(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


def test_eviction_drops_least_recently_used_text_first():
    tree = PrefixTree()
    tree.insert("old text one", 0)
    tree.insert("new text two", 0)
    tree.insert("old text one", 1)
    tree.evict(0, max_chars=len("new text two"))
    assert tree.chars[0] <= len("new text two")
    assert tree.match("new text two") == {0: 12}
    assert tree.match("old text one") == {1: 12}     # replica 1's copy stays


def test_shared_prefixes_stick_to_one_replica_and_new_ones_spread():
    router = CacheAwareRouter(2)
    prefixes = ["system prompt A " * 8, "system prompt B " * 8]
    first = [router.route(p + "question 0")[0] for p in prefixes]
    assert sorted(first) == [0, 1]                    # new prefixes: least loaded, then emptier
    for i in range(1, 5):
        for p, replica in zip(prefixes, first):
            assert router.route(p + f"question {i}") == (replica, "cache")
    assert router.loads == [5, 5]
    router.finished(0)
    assert router.loads == [4, 5]


def test_imbalance_overrides_the_cache():
    router = CacheAwareRouter(2, RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    text = "shared prefix " * 10
    replicas = [router.route(text + str(i)) for i in range(4)]
    assert replicas[:3] == [(0, "load"), (0, "cache"), (0, "cache")]
    assert replicas[3] == (1, "balance")             # 3 in flight on 0, none on 1: 3 - 0 > 2


def test_a_short_match_goes_to_the_least_loaded():
    router = CacheAwareRouter(2, RouterConfig(cache_threshold=0.9))
    router.route("abcdefghij")
    assert router.route("abcdefgh__")[1] == "load"   # 8 / 10 is not above 0.9


def test_routing_text_keeps_conversation_prefixes():
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    a = routing_text("/v1/chat/completions", {"messages": first})
    b = routing_text("/v1/chat/completions", {"messages": later})
    assert b.startswith(a)
    assert routing_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"


@pytest.mark.parametrize("kwargs", [dict(cache_threshold=1.5), dict(balance_rel_threshold=0.5),
                                    dict(max_tree_chars=0)])
def test_bad_router_config_is_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)).split("_")[0]):
        RouterConfig(**kwargs)


def test_down_replicas_are_routed_around_until_up():
    router = CacheAwareRouter(2)
    text = "cached on replica zero " * 4
    assert router.route(text)[0] == 0
    router.mark_down(0)
    assert router.route(text) == (1, "load")
    router.mark_down(1)
    with pytest.raises(RuntimeError, match="all 2 replicas are unreachable"):
        router.route(text)
    router.mark_up(0)
    assert router.route(text) == (0, "cache")
