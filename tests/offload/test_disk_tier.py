"""The disk tier: direct reads, the weight store round trip, head chunks, KV blocks on disk,
and the loader's ordering."""
import os
import time

import pytest
import torch
from torch import nn

from kvforge.offload.direct_io import (ALIGN, AlignedBuffer, DiskFile, probe_file, read_while,
                                       write_file)
from kvforge.offload.kv_disk import DiskKVLayer, plan_block_reads
from kvforge.offload.loader import Stage, StageLoader
from kvforge.offload.trace import TraceRecorder
from kvforge.offload.weight_store import WeightStore, _layout, _raw, layer_tensors


def test_direct_file_reads_what_was_written_and_evicts_the_page_cache(tmp_path):
    path = str(tmp_path / "f.bin")
    data = os.urandom(3 * ALIGN)
    write_file(path, [(0, data)], 3 * ALIGN)
    f = DiskFile(path)
    buf = AlignedBuffer(2 * ALIGN)
    f.read_into(buf.view[:2 * ALIGN], ALIGN)
    assert bytes(buf.view[:2 * ALIGN]) == data[ALIGN:]
    assert f.bytes_read == 2 * ALIGN
    f.close()


def test_read_while_reads_the_disk_tier_during_the_work_and_cleans_up(tmp_path):
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.2)

    with probe_file(str(tmp_path), nbytes=8 << 20, chunk=1 << 20) as (path, write_rate):
        assert write_rate > 0 and os.path.getsize(path) == 8 << 20
        rate, seconds = read_while(path, work, nbytes=8 << 20, chunk=1 << 20)
    assert calls == [1] and seconds >= 0.2
    assert rate > 0                     # the reader thread ran beside the work
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("chunk", [256 << 10, 1 << 20, 3 << 20])
def test_probe_file_is_written_in_full_at_any_chunk(tmp_path, chunk):
    """A probe with holes would be read without touching the disk (a 256 KiB chunk once
    wrote none of its bytes and 'read' at 16 GB/s)."""
    nbytes = 4 * chunk
    with probe_file(str(tmp_path), nbytes=nbytes, chunk=chunk) as (path, _):
        assert os.stat(path).st_blocks * 512 >= nbytes       # allocated: no holes
        with open(path, "rb") as f:
            data = f.read()
    assert len(data) == nbytes and data.count(0) < nbytes // 64


def test_probe_file_refuses_a_chunk_that_does_not_tile_it(tmp_path):
    with pytest.raises(ValueError, match="probe chunk"):
        with probe_file(str(tmp_path), nbytes=1 << 20, chunk=3000):
            pass
    assert list(tmp_path.iterdir()) == []


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(5, 3, bias=False)
        self.register_buffer("scale", torch.arange(3.0))


def test_layer_layout_round_trip_and_bind(tmp_path):
    src, dst = TwoLinear(), TwoLinear()
    entries, size = _layout(layer_tensors(src))
    assert all(e["offset"] % ALIGN == 0 for e in entries) and size % ALIGN == 0
    tensors = dict(layer_tensors(src))
    path = str(tmp_path / "layer.bin")
    write_file(path, [(e["offset"], _raw(tensors[e["name"]])) for e in entries], size)
    store = WeightStore.__new__(WeightStore)
    store.layers = [{"file": "layer.bin", "nbytes": size, "tensors": entries}]
    buf = AlignedBuffer(size)
    DiskFile(path).read_into(buf.view[:size], 0)
    store.bind_layer(dst, 0, buf.tensor)
    x = torch.randn(2, 8)
    assert torch.equal(dst.b(dst.a(x)) * dst.scale, src.b(src.a(x)) * src.scale)
    assert dst.a.weight.untyped_storage().data_ptr() == buf.tensor.data_ptr()


def test_layer_with_a_hidden_tensor_attribute_is_refused():
    layer = TwoLinear()
    layer.a.cached = torch.zeros(2)
    with pytest.raises(ValueError, match="a.cached is not a parameter or buffer"):
        layer_tensors(layer)


def test_block_read_plan_coalesces_runs_and_short_gaps():
    plan = plan_block_reads([7, 3, 4, 5, 9, 20, 21])
    assert plan.runs == [(3, 7, 0), (20, 2, 7)]     # 3..9 read through the gaps at 6 and 8
    assert plan.num_local == 9
    assert [plan.local_of[b] for b in (3, 5, 7, 9, 20, 21)] == [0, 2, 4, 6, 7, 8]


def test_disk_kv_layer_round_trip_through_slots(tmp_path):
    shape = (16, 2, 32)                       # block of 16 tokens x 2 heads x 32 dims, fp32
    layer = DiskKVLayer(str(tmp_path / "kv"), num_slots=40, block_shape=shape,
                        dtype=torch.float32)
    assert layer.block_bytes % ALIGN == 0 and layer.slot_bytes == 2 * layer.block_bytes
    plan = plan_block_reads([2, 3, 30])       # slots; 2..3 one run, 30 another
    assert plan.runs == [(2, 2, 0), (30, 1, 2)]
    buf = AlignedBuffer(layer.staging_bytes(plan))
    staged = layer.staging_view(buf.tensor, plan)
    staged.copy_(torch.randn_like(staged))
    expect = staged.clone()
    # local blocks 1 (slot 3) and 2 (slot 30) go to fresh slots 10, 11 in one vectored write
    layer.write(plan.num_local, [(10, [plan.local_of[3], plan.local_of[30]])], buf.view)
    assert layer.bytes_written == 2 * layer.slot_bytes
    layer.copy_slots([(11, 12)])
    moved = plan_block_reads([10, 11, 12])
    buf2 = AlignedBuffer(layer.staging_bytes(moved))
    layer.read(moved, buf2.view)
    got = layer.staging_view(buf2.tensor, moved)
    assert torch.equal(got[:, 0], expect[:, plan.local_of[3]])          # K and V planes both
    assert torch.equal(got[:, 1], expect[:, plan.local_of[30]])
    assert torch.equal(got[:, 2], expect[:, plan.local_of[30]])         # the copy
    staged.zero_()
    layer.read(plan, buf.view)
    assert not staged.any()                   # slots 2, 3, 30 were never written: zeros
    layer.close()


def test_disk_kv_layer_resumes_a_short_vectored_transfer(tmp_path, monkeypatch):
    """preadv / pwritev may move fewer bytes than asked: the rest follows at the right place."""
    shape = (16, 2, 32)
    layer = DiskKVLayer(str(tmp_path / "kv"), num_slots=8, block_shape=shape,
                        dtype=torch.float32)
    plan = plan_block_reads([0, 1, 2])
    buf = AlignedBuffer(layer.staging_bytes(plan))
    staged = layer.staging_view(buf.tensor, plan)
    staged.copy_(torch.randn_like(staged))
    expect = staged.clone()
    real_write, real_read = os.pwritev, os.preadv

    def short(real):
        def op(fd, views, offset):               # at most one page a call
            return real(fd, [views[0][:ALIGN]], offset)
        return op

    monkeypatch.setattr(os, "pwritev", short(real_write))
    layer.write(plan.num_local, [(4, [0, 1, 2])], buf.view)
    monkeypatch.setattr(os, "preadv", short(real_read))
    staged.zero_()
    layer.read(plan_block_reads([4, 5, 6]), buf.view)
    assert torch.equal(staged, expect)
    layer.close()


@pytest.mark.parametrize("prefetch", [True, False])
def test_loader_serves_stages_in_order_and_refuses_out_of_order(prefetch):
    reads = []

    def stage(i):
        def read(buf):
            reads.append(i)
            buf[:1] = bytes([i])
        return Stage(f"s{i}", read)

    loader = StageLoader(ALIGN, 2 if prefetch else 1, prefetch, TraceRecorder())
    loader.schedule([stage(i) for i in range(5)])
    for i in range(4):
        slot = loader.acquire(f"s{i}")
        assert slot.tensor[0].item() == i
        loader.release(slot)
    with pytest.raises(RuntimeError, match=r"out of order: compute wants 's7', the loader "
                                           r"holds 's4' \(issued \[.*\], next pending \[\]\)"):
        loader.acquire("s7")
    loader.close()
    assert reads[:4] == [0, 1, 2, 3]


def test_loader_threads_finish_out_of_order_but_serve_in_schedule_order():
    """Several reader threads (the KV loader's): a later stage may land first, compute still
    gets every stage in schedule order with its own bytes, and stages wait for free slots."""
    import random
    import time
    rng = random.Random(0)
    delays = [0.05] + [rng.uniform(0, 0.004) for _ in range(23)]   # s0 lands after s1
    finished = []

    def stage(i):
        def read(buf):
            time.sleep(delays[i])
            buf[:2] = bytes([i, 255 - i])
            finished.append(i)
        return Stage(f"s{i}", read)

    with pytest.raises(ValueError, match="threads < slots"):
        StageLoader(ALIGN, 3, True, TraceRecorder(), threads=3)
    loader = StageLoader(ALIGN, 4, True, TraceRecorder(), threads=3)
    loader.schedule([stage(i) for i in range(24)])
    for i in range(24):
        slot = loader.acquire(f"s{i}")
        assert (slot.tensor[0].item(), slot.tensor[1].item()) == (i, 255 - i)
        loader.release(slot)
    loader.close()
    assert sorted(finished) == list(range(24))
    assert finished.index(1) < finished.index(0)     # another thread read on meanwhile
