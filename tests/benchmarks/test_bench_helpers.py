"""Data loading, cost accounting and measurement helpers of benchmarks/ (no timed assertions)."""
from __future__ import annotations

import itertools
import json
import math
import time

import pytest
import torch

from benchmarks.common import parse_engine_args
from benchmarks.hardware import (ReadBandwidthSampler, cpu_model_name, measure_gemm_peak_flops,
                                 physical_cores)
from benchmarks.model_cost import ModelShape
from benchmarks.report import format_table
from benchmarks.systems import RunResult, left_pad, static_batches, timed_run
from benchmarks.workload import synthetic_requests
from kvforge.bench.sharegpt import (BenchRequest, first_exchange, iter_json_array,
                                    sample_sharegpt_requests, sharegpt_json_path)


# --- factories ---------------------------------------------------------------------------------
def conversation(human: str, gpt: str, cid: str = "x") -> dict:
    return {"id": cid, "conversations": [{"from": "human", "value": human},
                                         {"from": "gpt", "value": gpt}]}


def write_truncated_array(path, entries: list, cut: int) -> None:
    """Pretty-printed array like the ShareGPT file, cut ``cut`` characters before its end."""
    text = json.dumps(entries, indent=2)
    path.write_text(text[:-cut] if cut else text, encoding="utf-8")


def word_ids(text: str) -> list[int]:
    """A stand-in tokenizer: one id per whitespace-separated word."""
    return [len(w) for w in text.split()]


def tiny_shape() -> ModelShape:
    return ModelShape(hidden_size=32, intermediate_size=48, vocab_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8)


# --- iter_json_array ----------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_chars", [1, 3, 7, 64, 1 << 20])
def test_complete_array_matches_json_loads(tmp_path, chunk_chars):
    data = [{"a": [1, 2, {"b": "c, ] }"}]}, 12345, "x", [], {"k": -0.5e3}, None, True]
    p = tmp_path / "a.json"
    p.write_text(json.dumps(data, indent=1), encoding="utf-8")
    assert list(iter_json_array(p, chunk_chars=chunk_chars)) == json.loads(p.read_text())


@pytest.mark.parametrize("chunk_chars", [5, 1 << 20])
def test_truncated_tail_is_dropped_cleanly(tmp_path, chunk_chars):
    entries = [conversation(f"q{i}", f"a{i}", str(i)) for i in range(5)]
    p = tmp_path / "t.json"
    # cut inside the last entry: four complete entries survive
    write_truncated_array(p, entries, cut=20)
    assert list(iter_json_array(p, chunk_chars=chunk_chars)) == entries[:4]


def test_empty_and_non_array_inputs(tmp_path):
    empty = tmp_path / "e.json"
    empty.write_text("[]", encoding="utf-8")
    assert list(iter_json_array(empty)) == []
    bad = tmp_path / "b.json"
    bad.write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="JSON array"):
        list(iter_json_array(bad))


def test_real_sharegpt_file_streams_entries():
    path = sharegpt_json_path()
    first = list(itertools.islice(iter_json_array(path), 3))
    assert len(first) == 3 and all("conversations" in e for e in first)


# --- first_exchange / sampling ------------------------------------------------------------------
def test_first_exchange_picks_first_human_then_next_gpt():
    entry = {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "Q"},
                               {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A"}]}
    assert first_exchange(entry) == ("Q", "A")
    assert first_exchange(conversation("q", "a")) == ("q", "a")
    assert first_exchange({"conversations": [{"from": "human", "value": "q"}]}) is None
    assert first_exchange({"conversations": [{"from": "human", "value": "q"},
                                             {"from": "human", "value": "r"}]}) is None
    assert first_exchange("not a dict") is None


def test_sampling_filters_caps_and_is_seeded(tmp_path):
    entries = [conversation("one two three", "a " * 10, "ok1"),
               conversation("word " * 50, "a b", "too_long_prompt"),
               conversation("   ", "a b", "empty_prompt"),
               conversation("one two", "   ", "empty_answer"),
               conversation("x y z w", "a " * 3, "ok2"),
               {"id": "single", "conversations": [{"from": "human", "value": "q"}]}]
    p = tmp_path / "s.json"
    write_truncated_array(p, entries + [conversation("cut", "off")], cut=10)
    reqs = sample_sharegpt_requests(word_ids, 2, seed=1, max_output_len=5, max_prompt_len=10, path=p)
    assert sorted((r.prompt, r.output_len) for r in reqs) == [("one two three", 5), ("x y z w", 3)]
    assert all(r.prompt_token_ids == word_ids(r.prompt) for r in reqs)
    with pytest.raises(ValueError, match="only 2 usable"):
        sample_sharegpt_requests(word_ids, 3, max_prompt_len=10, path=p)


def test_sampling_order_depends_on_seed_only(tmp_path):
    entries = [conversation(f"prompt {i}", "a b c", str(i)) for i in range(40)]
    p = tmp_path / "s.json"
    write_truncated_array(p, entries, cut=0)

    def prompts(seed):
        return [r.prompt for r in sample_sharegpt_requests(word_ids, 10, seed=seed, path=p)]

    assert prompts(3) == prompts(3)
    assert prompts(3) != prompts(4)


def test_synthetic_requests_have_exact_lengths_and_distinct_starts():
    reqs = synthetic_requests([5, 6, 7], num_requests=3, prompt_len=7, output_len=4)
    assert [r.prompt_token_ids for r in reqs] == [[5, 6, 7, 5, 6, 7, 5], [6, 7, 5, 6, 7, 5, 6],
                                                  [7, 5, 6, 7, 5, 6, 7]]
    assert all(r.output_len == 4 for r in reqs)
    with pytest.raises(ValueError):
        BenchRequest([], 3)
    with pytest.raises(ValueError, match="output_len"):
        BenchRequest([1], 0)


# --- model cost ---------------------------------------------------------------------------------
def tiny_hf_llama(tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM
    s = tiny_shape()
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size,
                      intermediate_size=s.intermediate_size, num_hidden_layers=s.num_layers,
                      num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                      head_dim=s.head_dim, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def test_matmul_params_match_hf_linear_layers():
    model = tiny_hf_llama(tie=False)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    shape = ModelShape.from_config(model.config)
    assert shape == tiny_shape()
    assert shape.matmul_params == linear


def test_decode_bytes_cover_every_weight_of_a_tied_model():
    model = tiny_hf_llama(tie=True)
    shape = ModelShape.from_config(model.config)
    all_params = sum(p.numel() for p in model.parameters())     # tied: embedding counted once
    # the tied matrix is read whole as LM head, plus one embedding row for the input token
    assert shape.decode_bytes_per_token(0) == 4 * (all_params + shape.hidden_size)
    kv_per_token = 2 * 2 * 2 * 8 * 4                              # layers * (K,V) * kv_heads * hd * 4
    assert shape.decode_bytes_per_token(10) - shape.decode_bytes_per_token(0) == 10 * kv_per_token


def test_request_flops_against_a_per_position_count():
    s = tiny_shape()
    prompt, output = 5, 3
    expected = 0.0
    for pos in range(prompt + output - 1):             # positions fed through the layers
        expected += 2 * s.layer_matmul_params
        expected += s.num_layers * s.num_heads * (2 * s.head_dim * (pos + 1)) * 2   # qk and pv
    expected += output * 2 * s.head_params             # one logits row per sampled token
    assert s.request_flops(prompt, output) == pytest.approx(expected)
    assert s.decode_flops(prompt, 1) == 0
    assert s.decode_flops(prompt, output) == pytest.approx(
        expected - s.request_flops(prompt, 1))
    with pytest.raises(ValueError, match="prompt_len"):
        s.request_flops(0, 1)


def test_kvforge_and_hf_configs_give_the_same_shape():
    from kvforge.models.config import ModelConfig
    model = tiny_hf_llama(tie=True)
    kv_cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    assert ModelShape.from_config(kv_cfg) == ModelShape.from_config(model.config)


def test_model_shape_rejects_bad_values():
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape(32, 48, 128, 0, 4, 2, 8)


# --- HF batching helpers ------------------------------------------------------------------------
def test_left_pad_right_aligns_prompts():
    ids, mask = left_pad([[1, 2], [3, 4, 5, 6], [7]], pad_id=0)
    assert ids.tolist() == [[0, 0, 1, 2], [3, 4, 5, 6], [0, 0, 0, 7]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    with pytest.raises(ValueError):
        left_pad([[1], []], pad_id=0)


def test_static_batches_keep_arrival_order():
    reqs = synthetic_requests([1, 2, 3, 4, 5], 5, 2, 1)
    batches = static_batches(reqs, 2)
    assert [len(b) for b in batches] == [2, 2, 1]
    assert [r for b in batches for r in b] == reqs
    with pytest.raises(ValueError, match="batch_size"):
        static_batches(reqs, 0)


class FakeSystem:
    name = "fake"

    def __init__(self, produce):
        self.produce = produce

    def generate(self, requests):
        return [min(self.produce, r.output_len) for r in requests]


def test_timed_run_counts_useful_tokens_and_flops(capsys):
    s = tiny_shape()
    reqs = [BenchRequest([1, 2, 3], 4), BenchRequest([1], 2)]
    res = timed_run(FakeSystem(produce=3), reqs, s)
    assert (res.num_requests, res.prompt_tokens, res.output_tokens) == (2, 4, 5)
    assert res.flops == pytest.approx(s.request_flops(3, 3) + s.request_flops(1, 2))
    assert "stopped 1 requests early" in capsys.readouterr().out


def test_run_result_rates():
    r = RunResult("x", num_requests=4, elapsed_s=2.0, prompt_tokens=10, output_tokens=30, flops=8e9)
    assert (r.requests_per_s, r.output_tok_per_s, r.total_tok_per_s) == (2.0, 15.0, 20.0)
    assert r.mfu(peak_flops=8e9) == 0.5
    assert r.as_dict(8e9)["mfu"] == 0.5


# --- hardware / report / cli --------------------------------------------------------------------
def test_cpu_model_name_reads_cpuinfo(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t: avx\n", encoding="utf-8")
    assert cpu_model_name(str(p)) == "Test CPU 9000"
    assert physical_cores() >= 1


def test_measurements_are_positive_and_finite():
    peak = measure_gemm_peak_flops(n=64, reps=1)
    bw = ReadBandwidthSampler(num_bytes=1 << 20).sample()            # one pass at least
    assert math.isfinite(peak) and peak > 0
    assert math.isfinite(bw) and bw > 0
    sampler = ReadBandwidthSampler(num_bytes=1 << 20, sample_seconds=0.02)
    t0 = time.perf_counter()
    assert all(math.isfinite(b) and b > 0 for b in (sampler.sample(), sampler.sample()))
    assert time.perf_counter() - t0 >= 0.04
    with pytest.raises(ValueError, match="num_bytes"):
        ReadBandwidthSampler(num_bytes=2)
    # the bound reads huge pages where kvforge's weights get them
    from kvforge.kernels.huge_pages import huge_pages_available
    assert ReadBandwidthSampler(num_bytes=8 << 20).huge_pages == huge_pages_available()


def test_format_table_aligns_columns():
    out = format_table(["system", "tok/s"], [["a", 1.5], ["longer", 1234.0]]).splitlines()
    assert out[0] == "system |    tok/s"
    assert out[2] == "a      |     1.50"
    assert out[3] == "longer | 1,234.00"
    with pytest.raises(ValueError):
        format_table(["a", "b"], [[1]])


def test_parse_engine_args():
    assert parse_engine_args(["max_num_seqs=128", "kv_cache_memory=2GiB", "enable_chunked_prefill=False"]) \
        == {"max_num_seqs": 128, "kv_cache_memory": "2GiB", "enable_chunked_prefill": False}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_engine_args(["oops"])


# --- the scripts end to end, with fake systems (checks the report, not any speed) ---------------
class FakeClock:
    """A perf_counter that only the fake systems advance: timings exact on a loaded machine."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class SleepySystem:
    """Produces every target token; takes a fixed time per token (on ``clock`` when given, else
    a real sleep) so timings are positive."""

    def __init__(self, name, seconds_per_token, clock=None):
        self.name, self.seconds_per_token, self.batch_size = name, seconds_per_token, 1
        self.clock = clock

    def generate(self, requests):
        import time
        seconds = self.seconds_per_token * sum(r.output_len for r in requests)
        if self.clock is not None:
            self.clock.now += seconds
        else:
            time.sleep(seconds)
        return [r.output_len for r in requests]


def fake_config():
    from types import SimpleNamespace
    s = tiny_shape()
    return SimpleNamespace(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                           vocab_size=s.vocab_size, num_hidden_layers=s.num_layers,
                           num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
                           head_dim=s.head_dim)


class FakeSampler:
    """Read bandwidth that alternates 1 and 3 GB/s: every rep's bound uses the mean, 2 GB/s."""

    huge_pages = False

    def __init__(self, num_bytes, sample_seconds):
        self.count = 0

    def sample(self):
        self.count += 1
        return 1e9 if self.count % 2 else 3e9


@pytest.fixture
def fake_systems(monkeypatch):
    import benchmarks.latency as latency
    import benchmarks.throughput as throughput
    clock = FakeClock()       # latency.py subtracts two timings: real sleeps jitter under load
    kv, hf = SleepySystem("kvforge", 1e-4, clock), SleepySystem("HF transformers", 4e-4, clock)
    monkeypatch.setattr(latency, "time", clock)
    for mod in (throughput, latency):
        monkeypatch.setattr(mod, "build_systems", lambda args, hf_batch_size=16: (kv, hf, word_ids))
        monkeypatch.setattr(mod, "model_config_of", lambda kv, hf: fake_config())
    monkeypatch.setattr(throughput, "measure_gemm_peak_flops", lambda: 1e9)
    monkeypatch.setattr(throughput, "sample_sharegpt_requests",
                        lambda encode, n, **kw: synthetic_requests([1, 2, 3], n, 5, 20))
    monkeypatch.setattr(latency, "ReadBandwidthSampler", FakeSampler)
    return throughput, latency


def test_throughput_script_reports_ratio_and_summary(fake_systems, tmp_path, capsys):
    throughput, _ = fake_systems
    out_json = tmp_path / "t.json"
    payload = throughput.main(["--num-prompts", "4", "--decode-batch", "2", "--decode-output-len", "8",
                               "--json", str(out_json)])
    text = capsys.readouterr().out
    summary = [line for line in text.splitlines() if line.startswith("SUMMARY throughput:")]
    assert len(summary) == 1 and "kvforge" in summary[0] and "vs HF" in summary[0]
    assert [r["output_tokens"] for r in payload["results"]] == [80, 80]
    assert len(payload["decode_heavy"]) == 2
    assert json.loads(out_json.read_text())["summary"] == payload["summary"]


def test_latency_script_reports_bound(fake_systems, capsys):
    _, latency = fake_systems
    payload = latency.main(["--prompt-len", "4", "--output-len", "8", "--reps", "3"])
    text = capsys.readouterr().out
    assert text.count("SUMMARY latency:") == 1 and "of bound" in text
    s = tiny_shape()
    bound_ms = s.decode_bytes_per_token(4 + 4) / 2e9 * 1e3      # each rep between 1 and 3 GB/s
    assert payload["bound_ms_per_token"] == pytest.approx(bound_ms)
    for row in payload["results"]:
        assert len(row["runs"]) == 3
        for run in row["runs"]:
            assert run["bandwidth_bytes_per_s"] == pytest.approx(2e9)
            assert run["fraction_of_bound"] == pytest.approx(bound_ms / run["decode_ms_per_token"])
        assert row["fraction_of_bound_min"] <= row["fraction_of_bound"] <= row["fraction_of_bound_max"]
    assert [r["system"] for r in payload["results"]] == ["kvforge", "HF transformers"]


def test_hardware_line_names_caches_and_kernel_isa(tmp_path, monkeypatch):
    from benchmarks import hardware
    for i, (level, kind, size) in enumerate([(1, "Data", "48K"), (1, "Instruction", "32K"),
                                             (2, "Unified", "1024K")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    assert hardware.cache_sizes(str(tmp_path)) == "L1d 48K L2 1024K"
    assert hardware.cache_sizes(str(tmp_path / "missing")) == ""
    monkeypatch.setenv("KVFORGE_KERNELS", "0")
    assert "kernels off" in hardware.hardware_line()
    monkeypatch.setenv("KVFORGE_KERNELS", "1")
    monkeypatch.setenv("KVFORGE_ISA", "native")
    assert "kernels native (KVFORGE_ISA=native" in hardware.hardware_line()


def test_kv_fp8_quality_compares_up_to_the_first_differing_token():
    from types import SimpleNamespace
    from benchmarks.kv_fp8 import _quality
    ref = SimpleNamespace(token_ids=[5, 6, 7], logprobs=[{5: -0.5}, {6: -1.0}, {7: -2.0}])
    same = SimpleNamespace(token_ids=[5, 6, 7], logprobs=[{5: -0.6}, {6: -1.2}, {7: -2.0}])
    assert _quality(same, ref) == ("yes", f"{(0.1 + 0.2 + 0.0) / 3:.4f}")
    flipped = SimpleNamespace(token_ids=[5, 9, 7], logprobs=[{5: -0.7}, {9: -0.9}, {7: -2.0}])
    assert _quality(flipped, ref) == ("to token 1", "0.2000")
    first = SimpleNamespace(token_ids=[8, 6, 7], logprobs=[{8: -0.1}, {6: -1.0}, {7: -2.0}])
    assert _quality(first, ref) == ("to token 0", "-")
