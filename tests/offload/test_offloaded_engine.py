"""An offloaded tiny random Llama: greedy tokens identical to the same model fully in memory
(which tests/engine holds to HF transformers), for every policy, with streamed weights, KV on
disk, several batches per block and mixed prefill/decode steps; and the RAM it holds stays
within the budget."""
import pytest

from kvforge import LLM, SamplingParams
from kvforge.offload.cost_model import SAMPLE_ROWS_PER_CALL, kv_staging_slots
from tests.offload.conftest import greedy_in_memory

PROMPTS = ["The quick brown fox jumps over the lazy dog and then",
           "Once upon a time",
           "In a galaxy far, far away, a small robot named Bolt dreamed of",
           "1 2 3 4 5",
           "Hello, my name is",
           "The capital of France is Paris, and the capital of Italy is"]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_factory):
    d, _ = tiny_model_factory("llama", num_hidden_layers=4)
    return d


@pytest.fixture(scope="module")
def in_memory_tokens(tiny_dir):
    return greedy_in_memory(tiny_dir, PROMPTS, PARAMS)


@pytest.fixture(scope="module")
def offload_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("offload"))     # one weight store for the module


def offloaded(tiny_dir, offload_dir, **kwargs):
    kwargs.setdefault("offload_memory_budget", "64MiB")
    return LLM(tiny_dir, max_model_len=128, offload_dir=offload_dir,
               max_num_batched_tokens=24, enable_prefix_caching=False, **kwargs)


@pytest.mark.parametrize("policy, block_batches", [
    ("w=0,kv=0", 3),          # every layer streamed, every layer's KV on disk, 3 batches
    ("w=50,kv=50", 2),        # mixed placements
    ("naive", None),
    ("lp", None),
])
def test_greedy_identical_to_in_memory(tiny_dir, offload_dir, in_memory_tokens, policy,
                                       block_batches):
    llm = offloaded(tiny_dir, offload_dir, offload_policy=policy, offload_batch_size=2,
                    offload_block_batches=block_batches)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    model = llm.engine.runner.model
    assert got == in_memory_tokens
    if policy == "w=0,kv=0":
        assert len(model.kv_disk) == 4 and not model.resident_layers
        assert model.bytes_written > 0      # KV went to disk and came back
    assert model.store.bytes_read > 0
    llm.engine.check_integrity()
    llm.engine.shutdown()


def test_prefix_cache_over_disk_slots(tiny_dir, offload_dir):
    """Cached blocks keep their disk slots while the blocks written around them move: a
    second round of prompts that share a prefix reads it back from the cache."""
    shared = "The long history of the robot who lived near the harbour begins"
    prompts = [shared + s for s in (" with a storm", " on a quiet day", " in the year 2000")]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expect = greedy_in_memory(tiny_dir, prompts, params)
    llm = LLM(tiny_dir, max_model_len=128, offload_dir=offload_dir,
              offload_memory_budget="64MiB", offload_policy="w=0,kv=0", offload_batch_size=2,
              offload_block_batches=2, max_num_batched_tokens=24, enable_prefix_caching=True)
    slots = llm.engine.runner.model.kv_slots
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expect
        llm.engine.check_integrity()
    assert slots.slot_of != list(range(slots.num_blocks))     # written blocks moved
    assert llm.engine.kv_manager.prefix_cache_stats.hit_tokens > 0
    llm.engine.shutdown()


def test_a_failed_step_leaves_the_blocks_at_their_old_slots(tiny_dir, offload_dir, monkeypatch):
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=0,kv=0", offload_batch_size=2,
                    offload_block_batches=2)
    model = llm.engine.runner.model
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    before, free = list(model.kv_slots.slot_of), model.kv_slots.num_free
    layer = model.inner.model.layers[2]

    def broken(*args, **kwargs):
        raise RuntimeError("layer 2 failed")

    monkeypatch.setattr(layer.mlp, "forward", broken)
    llm.engine.add_request("x", PROMPTS[2], SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(RuntimeError, match="layer 2 failed"):
        llm.engine.step()
    assert model.kv_slots.slot_of == before
    assert model.kv_slots.num_free == free      # the step's fresh slots were given back
    model.kv_slots.check_integrity()
    llm.engine.shutdown()


def test_block_of_batches_reads_each_layer_once_per_step(tiny_dir, offload_dir):
    """Zig-zag: with 3 batches in the block a step reads each streamed layer once, not 3x."""
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=0,kv=100", offload_batch_size=2,
                    offload_block_batches=3)
    model = llm.engine.runner.model
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    layer_reads = [name for lane, name, _, _ in model.trace.events
                   if lane == "load" and name.startswith("layer")]
    forwards = sum(1 for lane, name, _, _ in model.trace.events
                   if lane == "compute" and name == "layer 0")
    assert forwards > 0
    assert len(layer_reads) == 4 * forwards
    llm.engine.shutdown()


def test_projections_take_the_whole_block_and_disk_kv_attends_per_batch(tiny_dir, offload_dir,
                                                                         in_memory_tokens):
    """A step runs each layer's q/k/v projection once over all of the block's rows (not once
    per batch); a RAM-KV layer attends over them in one call, a disk-KV layer batch by batch on
    its staged KV."""
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=0,kv=50", offload_batch_size=2,
                    offload_block_batches=3)
    model = llm.engine.runner.model
    layers = model.inner.model.layers
    assert sorted(model.kv_disk) == [2, 3]              # layers 0-1 keep their KV in RAM
    qkv_rows = {0: [], 3: []}
    attn_rows = {0: [], 3: []}
    for j in qkv_rows:
        layers[j].self_attn.qkv_proj.register_forward_hook(
            lambda mod, args, out, j=j: qkv_rows[j].append(args[0].shape[0]))
        backend = layers[j].self_attn.attn
        forward = backend.forward

        def counted(q, k, v, cache, meta, j=j, forward=forward):
            attn_rows[j].append(q.shape[0])
            return forward(q, k, v, cache, meta)

        backend.forward = counted
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == in_memory_tokens
    steps = sum(1 for lane, name, _, _ in model.trace.events
                if lane == "compute" and name == "layer 0")
    assert len(qkv_rows[0]) == len(qkv_rows[3]) == len(attn_rows[0]) == steps
    assert max(qkv_rows[3]) > 2                         # more than one batch's rows at once
    assert qkv_rows[0] == attn_rows[0]
    # disk KV: one attention call per batch (at most 2 rows a decode batch), same rows in all
    assert len(attn_rows[3]) > steps and sum(attn_rows[3]) == sum(qkv_rows[3])
    llm.engine.shutdown()


@pytest.mark.parametrize("policy, block_batches", [("lp", None), ("w=0,kv=0", 12)])
def test_fast_tier_bytes_stay_within_the_budget(tiny_dir, offload_dir, policy, block_batches):
    budget = 24 * 2 ** 20
    llm = offloaded(tiny_dir, offload_dir, offload_memory_budget=budget, offload_batch_size=2,
                    offload_policy=policy, offload_block_batches=block_batches)
    runner = llm.engine.runner
    model = runner.model
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    placement = runner.placement
    assert placement.fast_tier_bytes <= budget
    held = sum(b.nbytes for b in model._resident_buffers)
    held += sum(s.buffer.nbytes for s in model.loader.slots)
    if model.kv_loader is not None:
        # the ring the budget paid for: a block and a half of batches, at least 8
        assert model.kv_loader.num_slots == kv_staging_slots(placement.block_batches)
        assert model.kv_loader.num_slots >= 1.5 * placement.block_batches
        held += sum(s.buffer.nbytes for s in model.kv_loader.slots)
    else:
        assert policy == "lp"           # the explicit policy keeps every layer's KV on disk
    # the sampler's working copies the budget counts: one call's rows
    assert runner.sample_rows_per_call == SAMPLE_ROWS_PER_CALL
    held += sum(c.numel() * c.element_size() for j, c in enumerate(runner.kv_caches)
                if j not in model.kv_disk)
    assert held <= budget
    # no weights outside those buffers: every streamed layer's tensors live in a loader slot
    slots = [(s.buffer.tensor.data_ptr(), s.buffer.nbytes) for s in model.loader.slots]
    for j, layer in enumerate(model.inner.model.layers):
        if j in model.resident_layers:
            continue
        for p in layer.parameters():
            ptr = p.untyped_storage().data_ptr()
            assert any(a <= ptr < a + n for a, n in slots), f"layer {j} holds its own weights"
    assert model.inner.model.embed_tokens is None     # rows come from the disk tier
    llm.engine.shutdown()


def test_trace_file_written_at_shutdown(tiny_dir, offload_dir, tmp_path):
    import json
    path = tmp_path / "trace.json"
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=0,kv=0", offload_batch_size=2,
                    offload_block_batches=2, offload_trace=str(path))
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    llm.engine.shutdown()
    lanes = {e["cat"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"}
    assert lanes == {"load", "compute", "store"}


def test_disk_kv_files_leave_no_name_behind(tiny_dir, tmp_path):
    """The KV files are unlinked once open (their space returns when the process ends, shut
    down or not), and a dead process's leftover kv-<pid> directory is removed at start."""
    import os
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"kv-{dead}"
    stale.mkdir()
    (stale / "layer_0000.kv").write_bytes(b"\0" * 4096)
    llm = offloaded(tiny_dir, str(tmp_path), offload_policy="w=0,kv=0", offload_batch_size=2,
                    offload_block_batches=2)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert len(llm.engine.runner.model.kv_disk) == 4
    assert not stale.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("kv-")]
    llm.engine.shutdown()


def test_start_times_no_kernel_plans_under_a_budget(tiny_dir, offload_dir, monkeypatch,
                                                    tmp_path):
    """The tuner's cold weight copies (up to 256 MiB) would break the budget on a first start:
    an offloaded engine installs cached fp32 plans only; the in-memory engine still times."""
    from kvforge.kernels import tune

    monkeypatch.setenv("KVFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(tune.ENV_VAR, "1")
    timed = []
    real_tune_shape = tune.tune_shape
    monkeypatch.setattr(tune, "tune_shape", lambda *a, **k: timed.append(a[1:3]) or
                        real_tune_shape(*a, **k))
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=50,kv=50", offload_batch_size=2)
    llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
    llm.engine.shutdown()
    assert timed == [] and not (tmp_path / "tune").exists()
    tune.install([])
    shapes = [(64, 48, False, 8)]
    tune.tune_linear_shapes(shapes, progress=None)              # the in-memory path: timed
    assert timed == [(64, 48)]
    tune.install([])
    cached = tune.tune_linear_shapes(shapes, progress=None, measure=False)
    assert [t.key for t in cached] == ["48x64"] and timed == [(64, 48)]
    assert tune.installed()                                     # the cached plan applies
    tune.install([])


def test_the_prediction_for_a_partly_filled_block_is_for_its_batches(tiny_dir, offload_dir):
    """The benchmark compares a run's decode steps with the cost model's for the batches those
    steps filled: a full block gives the placement's own prediction, fewer sequences fewer
    batches (a shorter step), and the sequences of one batch cost the same step."""
    llm = offloaded(tiny_dir, offload_dir, offload_policy="w=0,kv=0", offload_batch_size=2,
                    offload_block_batches=3)
    runner = llm.engine.runner
    p = runner.placement
    assert p.block_seqs == 6
    assert runner.predicted_decode_step_s(6) == pytest.approx(p.predicted_step_s)
    two, one = runner.predicted_decode_step_s(4), runner.predicted_decode_step_s(2)
    assert one < two < p.predicted_step_s
    assert runner.predicted_decode_step_s(1) == one      # one batch either way
    assert runner.predicted_decode_step_s(3) == two
    with pytest.raises(ValueError, match="got 0"):
        runner.predicted_decode_step_s(0)
    llm.engine.shutdown()
