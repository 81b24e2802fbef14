"""Huge-page backed tensors (kernels/huge_pages.py) and the decode weights placed in them."""
import gc

import pytest
import torch

from kvforge.kernels import huge_pages
from kvforge.kernels.huge_pages import (HUGE_PAGE_BYTES, huge_page_bytes, huge_page_zeros,
                                        huge_pages_available)
from kvforge.kernels.ops import packing_pays
from kvforge.layers.linear import (Linear, PackedLinearMethod, UnquantizedLinearMethod,
                                   dense_weight, place_linears)

_BIG = HUGE_PAGE_BYTES // 4 * 3          # fp32 elements of 6 MiB: over the huge-page threshold


def _spans(tensors):
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]


def test_zeros_one_after_another_in_order():
    shapes = [(1000, 7), (3,), (_BIG,), (5, 2, 9)]
    tensors = huge_page_zeros(shapes)
    assert [tuple(t.shape) for t in tensors] == shapes
    spans = _spans(tensors)
    for t, (start, _) in zip(tensors, spans):
        assert t.is_contiguous() and t.dtype == torch.float32 and not t.any()
        assert start % 64 == 0
    # laid out in the order given, none overlapping, in one buffer (or separate tensors when
    # the machine grants no huge pages)
    if huge_pages_available():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        assert spans[0][0] % HUGE_PAGE_BYTES == 0
    for i, t in enumerate(tensors):                      # writes land in their own tensor only
        t.fill_(i + 1)
    assert [int(t.flatten()[0]) for t in tensors] == [1, 2, 3, 4]
    assert all(bool((t == i + 1).all()) for i, t in enumerate(tensors))


@pytest.mark.skipif(not huge_pages_available(), reason="this machine grants no huge pages")
def test_big_buffers_get_huge_pages():
    big, = huge_page_zeros([(_BIG,)])
    big.fill_(1.0)                                       # first touch faults the pages in
    assert huge_page_bytes(big) >= HUGE_PAGE_BYTES
    assert float(big.sum()) == _BIG


def test_mapping_outlives_every_other_reference():
    tensor = huge_page_zeros([(_BIG,)])[0][:10]          # a view of a view of the mapping
    gc.collect()
    tensor.copy_(torch.arange(10.0))
    assert tensor.tolist() == [float(i) for i in range(10)]


def test_plain_tensors_without_huge_pages(monkeypatch):
    def no_mapping(nbytes):
        raise AssertionError("mapped a buffer where plain tensors were due")

    monkeypatch.setattr(huge_pages, "_advised_buffer", no_mapping)
    small, = huge_page_zeros([(16,)])                    # under 2 MiB: never a mapping
    assert small.shape == (16,) and not small.any()
    monkeypatch.setattr(huge_pages, "huge_pages_available", lambda: False)
    a, b = huge_page_zeros([(_BIG,), (4, 4)])
    assert a.shape == (_BIG,) and b.shape == (4, 4) and not a.any() and not b.any()
    assert a.data_ptr() != b.data_ptr()


def test_environment_turns_huge_pages_off(monkeypatch):
    monkeypatch.setenv("KVFORGE_HUGE_PAGES", "0")
    assert not huge_pages_available()

    def no_mapping(nbytes):
        raise AssertionError("mapped a buffer with huge pages turned off")

    monkeypatch.setattr(huge_pages, "_advised_buffer", no_mapping)
    big, = huge_page_zeros([(_BIG,)])
    assert big.shape == (_BIG,) and not big.any()
    monkeypatch.setenv("KVFORGE_HUGE_PAGES", "1")
    assert huge_pages_available() == huge_pages._thp_advisable()


def test_other_devices_and_dtypes():
    half, = huge_page_zeros([(_BIG // 2,)], dtype=torch.float16)
    assert half.dtype == torch.float16 and half.shape == (_BIG // 2,)
    meta, = huge_page_zeros([(8,)], device="meta")
    assert meta.device.type == "meta"


def _layers(seed=0):
    g = torch.Generator().manual_seed(seed)
    layers = [Linear(64, 40, bias=True), Linear(32, 24), Linear(64, 48)]
    for layer in layers:
        layer.load_weight("weight", torch.randn(layer.output_size, layer.input_size, generator=g))
        if layer.has_bias:
            layer.load_weight("bias", torch.randn(layer.output_size, generator=g))
    return layers


@pytest.mark.parametrize("pack", [False, True])
def test_place_linears_same_outputs_in_step_order(monkeypatch, pack):
    monkeypatch.setattr(huge_pages, "HUGE_PAGE_BYTES", 4096)     # small layers, one buffer
    layers = _layers()
    x = {n: torch.randn(3, n) for n in (32, 64)}
    before = [layer(x[layer.input_size]) for layer in layers]
    weights = [layer.weight.clone() for layer in layers]
    place_linears(layers, pack=pack)
    packed = [type(layer.method) is PackedLinearMethod for layer in layers]
    assert packed == [pack and packing_pays()] * 3
    for layer, w, y in zip(layers, weights, before):
        assert torch.equal(dense_weight(layer), w)
        torch.testing.assert_close(layer(x[layer.input_size]), y, rtol=1e-5, atol=1e-5)
    stored = [layer.packed_weight if p else layer.weight for layer, p in zip(layers, packed)]
    if huge_pages.huge_pages_available():
        spans = _spans(stored)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))   # read order = memory order
        assert spans[-1][1] - spans[0][0] < 2 * sum(e - s for s, e in spans)


def test_place_linears_leaves_other_methods_and_shares_nothing():
    layers = _layers(1)

    class Other(UnquantizedLinearMethod):                 # stands for a quantized method
        pass

    layers[1].method = Other()
    shared = layers[2].weight                             # e.g. a tied embedding's table
    kept = layers[1].weight
    place_linears(layers, pack=False)
    assert layers[1].weight is kept                       # not ours to move
    assert layers[2].weight is not shared and torch.equal(layers[2].weight, shared)
    assert layers[2].weight.data_ptr() != shared.data_ptr()


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    return []


@pytest.mark.skipif(not huge_pages_available(), reason="this machine grants no huge pages")
def test_small_page_heads_keep_only_the_first_blocks_out_of_huge_pages():
    """The 2 MiB-aligned range around each plane's first bytes is advised no-huge-page (the
    first requests' KV faults in small pages); the rest of the buffer stays huge-page advised
    and gets huge pages; values are untouched."""
    planes = huge_page_zeros([(2 * _BIG,)] * 3)               # three 12 MiB planes
    assert huge_pages.small_page_heads(planes, nbytes=64 * 1024) == 3
    for plane in planes:
        assert "nh" in _vma_flags(plane.data_ptr())
        far = plane[HUGE_PAGE_BYTES:]                       # 8 MiB past the plane's start
        assert "hg" in _vma_flags(far.data_ptr()) and "nh" not in _vma_flags(far.data_ptr())
        plane.fill_(2.0)
        assert float(plane.sum()) == 2.0 * plane.numel()
    assert huge_page_bytes(planes[0][HUGE_PAGE_BYTES:]) >= HUGE_PAGE_BYTES


def test_engine_kv_planes_start_in_small_pages(default_model_path):
    """The runner keeps the first blocks of every K/V plane in small pages (a fresh huge page
    can take 10-17 ms to fault on a VM: the first token paid ~0.6 s for them)."""
    from kvforge import LLM
    llm = LLM(default_model_path, num_kv_blocks=4096)
    caches = llm.engine.runner.kv_caches
    if not huge_pages_available():
        pytest.skip("this machine grants no huge pages")
    for cache in caches:
        for plane in cache.unbind(0):
            assert "nh" in _vma_flags(plane.data_ptr())
    middle = caches[0][0]
    assert "hg" in _vma_flags(middle.data_ptr() + middle.numel() * 4 - HUGE_PAGE_BYTES // 2)
