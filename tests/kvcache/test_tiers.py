"""KV tiers: host pool allocator bookkeeping, and swap out -> swap in is bit-identical for the
host pool and for disk (memmap), for fp32, bf16 and fp8 caches."""
import os

import pytest
import torch

from kvforge.kvcache.tiers import HostKVPool, TieredKVStore

SHAPE = (2, 10, 4, 2, 3)        # [K/V, blocks, block_size, heads, head_dim]


def make_caches(dtype, layers=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    caches = [torch.randn(SHAPE, generator=g).to(dtype) for _ in range(layers)]
    if dtype == torch.float32:
        caches[0][0, 1, 0, 0, 0] = float("nan")      # bytes, not values, must round-trip
        caches[1][1, 2, 3, 1, 2] = -0.0
    return caches


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_host_pool_costs_no_resident_memory_until_blocks_are_written():
    """The swap mirror is as large as the engine's pool; only the blocks a swap-out writes
    may become resident (a zeroed pool made all of it resident at start)."""
    shape = (2, 1024, 16, 8, 64)                           # 64 MiB a layer in fp32
    before = _resident_bytes()
    pool = HostKVPool([shape] * 4, torch.float32, num_blocks=1024)
    assert _resident_bytes() - before < 32 << 20           # of 256 MiB
    pool.caches[0][:, :256] = 1.0                          # a quarter of one layer written
    assert _resident_bytes() - before >= 15 << 20


def test_host_pool_allocates_exact_ids_and_checks_owners():
    pool = HostKVPool([SHAPE], torch.float32, num_blocks=4)
    assert pool.allocate("a", 3) == [0, 1, 2]
    assert pool.allocate("b", 2) is None and pool.num_free_blocks == 1
    assert pool.allocate("b", 1) == [3]
    pool.check_integrity()
    with pytest.raises(ValueError, match="not held by 'b'"):
        pool.free("b", [0])
    pool.free("a", [0, 1, 2])
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool._free.append(3)                                   # corrupt: owned and free
    with pytest.raises(AssertionError):
        pool.check_integrity()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("host_blocks", [16, 0])            # 0: everything goes to disk
def test_swap_round_trip_is_bit_identical(tmp_path, dtype, host_blocks):
    caches = make_caches(dtype)
    store = TieredKVStore(caches, block_size=4, host_num_blocks=host_blocks,
                          cache_dir=str(tmp_path))
    src = [7, 2, 5]
    before = [c[:, src].clone() for c in caches]
    handle = store.swap_out("r1", src, num_tokens=10)
    assert handle.tier == ("host" if host_blocks else "disk")
    assert handle.num_bytes == 3 * sum(c[:, :1].numel() * c.element_size() for c in caches)
    store.check_integrity()
    if handle.tier == "disk":
        assert os.path.isfile(handle.path) and handle.path.startswith(str(tmp_path))
    for c in caches:                                         # the engine reuses the blocks
        c.view(torch.uint8).fill_(0xAB)
    dst = [9, 0, 4]
    store.swap_in("r1", dst)
    for c, b in zip(caches, before):
        assert torch.equal(c[:, dst].view(torch.uint8), b.view(torch.uint8))
    assert not store.handles and store.host.num_free_blocks == host_blocks
    assert not os.listdir(tmp_path)
    store.check_integrity()


def test_partial_swap_in_after_a_prefix_match_and_host_fallback_to_disk(tmp_path):
    caches = make_caches(torch.float32)
    store = TieredKVStore(caches, block_size=4, host_num_blocks=3, cache_dir=str(tmp_path))
    a_blocks, b_blocks = [1, 2, 3], [4, 5]
    a_before = [c[:, a_blocks].clone() for c in caches]
    b_before = [c[:, b_blocks].clone() for c in caches]
    assert store.swap_out("a", a_blocks, 12).tier == "host"
    assert store.swap_out("b", b_blocks, 6).tier == "disk"    # host pool is full
    with pytest.raises(ValueError, match="already swapped"):
        store.swap_out("a", [6], 1)
    store.check_integrity()
    # a's first block is still held by the prefix cache: only blocks 1.. come back
    store.swap_in("a", [8, 9], first_block=1)
    for c, before in zip(caches, a_before):
        assert torch.equal(c[:, [8, 9]].view(torch.uint8), before[:, 1:].view(torch.uint8))
    store.discard("b")
    store.discard("never-swapped")
    assert not store.handles and not os.listdir(tmp_path) and store.host.num_free_blocks == 3
    store.check_integrity()
    del b_before
