"""RadixTree with tiny pools: exact match lengths, splits, lock counts and eviction order."""
import pytest

from kvforge.kvcache.block_pool import BlockPool
from kvforge.kvcache.radix_tree import RadixTree

B = 4


def make_tree(num_blocks=16):
    pool = BlockPool(num_blocks)
    return pool, RadixTree(pool, B)


def seq(*blocks):
    """seq("a", "b") -> the tokens of blocks a and b: block "a" is [a0, a1, a2, a3] as ints."""
    return [ord(name) * 100 + i for name in blocks for i in range(B)]


def insert(tree, pool, *blocks):
    """Allocate one block per name (like a request would), cache them, drop the request's refs."""
    ids = pool.allocate(len(blocks))
    result = tree.insert(seq(*blocks), ids)
    pool.free(ids)                     # the tree's own reference keeps them
    return ids, result


def shape(node):
    """(num_blocks, {first-token: child shape}) of a subtree, for exact structure asserts."""
    return (node.num_blocks, {k[0]: shape(c) for k, c in sorted(node.children.items())})


def test_match_in_whole_blocks_and_mid_block_prefix_rounds_down():
    pool, tree = make_tree()
    ids, _ = insert(tree, pool, "a", "b", "c")
    assert tree.match_prefix(seq("a", "b", "c", "d")).num_tokens == 12
    m = tree.match_prefix(seq("a", "b") + seq("c")[:3])     # ends mid-block: 2 full blocks
    assert (m.num_tokens, m.block_ids) == (8, ids[:2])
    assert tree.match_prefix(seq("x")).num_tokens == 0
    assert tree.match_prefix(seq("a")[:3]).num_tokens == 0
    assert tree.match_length(seq("a", "b", "x")) == 8
    tree.check_integrity()


def test_match_splits_node_at_block_boundary():
    pool, tree = make_tree()
    ids, _ = insert(tree, pool, "a", "b", "c")
    assert shape(tree.root) == (0, {ord("a") * 100: (3, {})})
    m = tree.match_prefix(seq("a", "x"))
    assert m.block_ids == ids[:1] and m.node.block_ids == ids[:1]
    assert shape(tree.root) == (0, {ord("a") * 100: (1, {ord("b") * 100: (2, {})})})
    assert tree.num_nodes == 2 and tree.num_cached_blocks == 3
    tree.check_integrity()


def test_match_length_is_read_only():
    pool, tree = make_tree()
    insert(tree, pool, "a", "b", "c")
    assert tree.match_length(seq("a", "x")) == 4
    assert tree.num_nodes == 1
    tree.check_integrity()


def test_insert_branches_and_keeps_existing_blocks():
    pool, tree = make_tree()
    ab, _ = insert(tree, pool, "a", "b")
    dup = pool.allocate(3)                                  # same "a b" computed again + "c"
    result = tree.insert(seq("a", "b", "c"), dup)
    assert result.num_cached_tokens == 8
    assert tree.match_prefix(seq("a", "b", "c")).block_ids == [*ab, dup[2]]
    assert pool.ref_cnt(dup[0]) == 1 and pool.ref_cnt(dup[2]) == 2   # only "c" was taken
    pool.free(dup)
    assert pool.ref_cnt(dup[0]) == 0                         # duplicate back to the free queue
    x, _ = insert(tree, pool, "a", "x")
    assert shape(tree.root) == (0, {ord("a") * 100: (1, {
        ord("b") * 100: (1, {ord("c") * 100: (1, {})}), ord("x") * 100: (1, {})})})
    assert tree.num_cached_blocks == 4                       # a, b, c, x
    tree.check_integrity()


def test_insert_rejects_partial_blocks():
    pool, tree = make_tree()
    with pytest.raises(ValueError, match="insert needs"):
        tree.insert(seq("a")[:3], [0])


def test_lock_counts_propagate_to_ancestors_and_splits_inherit_them():
    pool, tree = make_tree()
    insert(tree, pool, "a", "b")
    _, r = insert(tree, pool, "a", "b", "c")
    tree.lock(r.node)                                        # pins a-b and c
    assert tree.num_evictable_blocks == 0
    m = tree.match_prefix(seq("a", "x"))                     # splits a-b into a | b
    assert m.node.lock_ref == 1 and m.node.children[tuple(seq("b"))].lock_ref == 1
    tree.lock(m.node)
    assert m.node.lock_ref == 2
    assert tree.direct_locks()[id(m.node)] == 1 and tree.direct_locks()[id(r.node)] == 1
    tree.unlock(r.node)
    assert tree.num_evictable_blocks == 2                    # b and c
    tree.unlock(m.node)
    assert tree.num_evictable_blocks == 3
    with pytest.raises(RuntimeError, match="not locked"):
        tree.unlock(m.node)
    tree.check_integrity()


def test_evicts_lru_leaves_first_and_parents_after_their_children():
    pool, tree = make_tree(num_blocks=8)
    a, _ = insert(tree, pool, "a", "b")                      # time 1
    _, _ = insert(tree, pool, "a", "b", "c")                 # a-b | c
    _, _ = insert(tree, pool, "x")
    tree.match_prefix(seq("a", "b", "c"))                    # a-b-c now most recent
    assert pool.num_free_blocks == 4
    evicted = tree.evict(1)
    assert evicted == pool.free_block_ids()[-1:]             # the x leaf, least recent
    assert tree.match_length(seq("x")) == 0
    evicted = tree.evict(1)                                  # the c leaf, not its parent
    assert tree.match_length(seq("a", "b", "c")) == 8
    evicted = tree.evict(1)                                  # a-b went last, tail block first
    assert evicted == [a[1], a[0]]
    assert tree.num_cached_blocks == 0 and pool.num_free_blocks == 8
    tree.check_integrity()
    pool.check_integrity()


def test_locked_nodes_are_never_evicted():
    pool, tree = make_tree(num_blocks=8)
    _, r = insert(tree, pool, "a", "b")
    _, s = insert(tree, pool, "a", "c")
    tree.lock(s.node)                                        # pins a and c; b is a free leaf
    assert r.node.block_ids == [r.node.block_ids[0]]         # the split left r.node as "b"
    assert tree.evict(10) == r.node.block_ids
    assert tree.num_cached_blocks == 2 and tree.match_length(seq("a", "c")) == 8
    assert tree.evict(10) == []
    tree.unlock(s.node)
    assert len(tree.evict(10)) == 2 and tree.num_cached_blocks == 0
    tree.check_integrity()


def test_cached_blocks_hold_a_reference_and_never_sit_in_the_free_queue():
    pool, tree = make_tree(num_blocks=4)
    ids, _ = insert(tree, pool, "a", "b")
    assert [pool.ref_cnt(b) for b in ids] == [1, 1]
    assert not set(ids) & set(pool.free_block_ids())
    assert pool.allocate(3) is None                          # only 2 truly free: caller evicts
    tree.check_integrity()
