"""The speed guard (spec/speed_guard.py): speculation runs only at batch sizes where its steps
were measured to give more tokens a second than decoding alone; probes keep both measurements
current. Unit level with simulated step times, then an engine whose speculative steps are made
slow on purpose."""
from __future__ import annotations

import random
import time

import pytest

from kvforge import LLM, SamplingParams
from kvforge.sched.output import SchedulerOutput
from kvforge.spec.decoder import SpecDecoder
from kvforge.spec.speed_guard import SpeedGuard
from tests.spec.test_spec_engine import _prompts
from tests.spec.test_spec_policy import Repeat, decoding


def _simulate(guard: SpeedGuard, batch: int, steps: int, spec_cost: float,
              plain_cost: float = 1.0) -> int:
    """Run ``steps`` steps at ``batch`` decodes; a speculative step takes ``spec_cost`` seconds
    a token, a plain one ``plain_cost``. Returns how many steps speculated."""
    speculated = 0
    for _ in range(steps):
        spec = guard.allow(batch)
        tokens = 3 * batch if spec else batch
        guard.record(batch, spec, (spec_cost if spec else plain_cost) * tokens, tokens)
        speculated += spec
    return speculated


def test_slower_speculation_is_paused_after_warm_up_and_probed_rarely():
    guard = SpeedGuard()
    speculated = _simulate(guard, batch=4, steps=400, spec_cost=1.2)
    assert guard.speculating(4) is False
    # warm-up (8 of 16 steps) plus one probe in every 16 steps
    assert guard.min_steps <= speculated <= 0.1 * 400, speculated
    assert guard.stats.probe_steps > 0 and guard.stats.denied_steps > 0.85 * 400


def test_faster_speculation_keeps_running_and_plain_decoding_is_probed():
    guard = SpeedGuard()
    speculated = _simulate(guard, batch=1, steps=400, spec_cost=0.8)
    assert guard.speculating(1) is True
    assert speculated >= 0.9 * 400
    assert guard.stats.probe_steps > 0           # plain steps re-measured now and then


def test_plain_warm_up_counts_positions_so_multi_step_calls_end_it_sooner():
    """A plain step of a multi-step call emits 4 tokens a row: 2 of them give the 8 positions
    the warm-up needs, where 8 calls (32 tokens held back from speculation) did before."""
    guard = SpeedGuard()
    arms = []
    while guard.speculating(2) is None:
        spec = guard.allow(2)
        arms.append(spec)
        guard.record(2, spec, 0.2 if spec else 0.8, 2 * (2 if spec else 4))
    assert arms.count(True) == guard.min_steps
    assert arms.count(False) == guard.min_steps // 4
    assert guard.speculating(2) is True          # 0.05 s a token speculating vs 0.1 plain


def test_batch_sizes_are_measured_apart():
    guard = SpeedGuard()
    _simulate(guard, batch=1, steps=100, spec_cost=0.7)
    _simulate(guard, batch=4, steps=100, spec_cost=1.3)
    assert guard.speculating(1) is True and guard.speculating(4) is False
    assert guard.speculating(2) is None


def test_probes_bring_speculation_back_when_it_pays_again():
    guard = SpeedGuard()
    _simulate(guard, batch=2, steps=200, spec_cost=1.5)
    assert guard.speculating(2) is False
    # acceptance went up for good (say the answer copies a long input): the probes' steps
    # fill the spec window with the new cost and the choice follows
    late = _simulate(guard, batch=2, steps=guard.window * guard.probe_every + 200,
                     spec_cost=0.5)
    assert guard.speculating(2) is True
    assert late > 150


def test_a_bad_stretch_does_not_pause_speculation_that_pays_on_average():
    """Bursty gains: 24 steps in which nothing is accepted (a speculative step costs 1.1 plain
    steps and emits one token), then 24 copying steps (4 tokens for 1.1): speculation pays
    ~1.6x on average and must keep running through the bad stretches."""
    guard = SpeedGuard()
    speculated = total = 0
    for _ in range(10):
        for tokens in (1, 4):
            for _ in range(24):
                spec = guard.allow(1)
                guard.record(1, spec, 1.1 if spec else 1.0, tokens if spec else 1)
                speculated += spec
                total += 1
    assert speculated > 0.85 * total, (speculated, total)


def _flips_under_noise(hysteresis: float) -> int:
    """Both arms cost the same up to +-4% noise per step: how often the choice changes."""
    rng = random.Random(0)
    guard, flips, last = SpeedGuard(hysteresis=hysteresis), 0, None
    for _ in range(600):
        spec = guard.allow(1)
        tokens = 3 if spec else 1
        guard.record(1, spec, rng.uniform(0.96, 1.04) * tokens, tokens)
        now = guard.speculating(1)
        flips += last is not None and now != last
        last = now
    return flips


def test_noise_within_the_hysteresis_does_not_flip_the_choice():
    assert _flips_under_noise(0.05) == 0
    assert _flips_under_noise(0.0) > 0           # without the margin the same noise does


@pytest.mark.parametrize("kwargs, name", [({"min_steps": 0}, "min_steps"),
                                          ({"min_steps": 40, "window": 32}, "min_steps"),
                                          ({"probe_every": 1}, "probe_every"),
                                          ({"hysteresis": 1.0}, "hysteresis")])
def test_bad_settings_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SpeedGuard(**kwargs)


def test_decoder_measures_decode_only_steps_and_obeys_the_guard():
    spec = SpecDecoder(3, Repeat(), 1000, guard=SpeedGuard())
    reqs = decoding(2)
    prefill = decoding(1)[0]
    # a step with a prefill chunk beside the decodes is not measured
    mixed = SchedulerOutput(scheduled=reqs + [prefill],
                            num_scheduled_tokens={"r0": 1, "r1": 1, prefill.request_id: 5})
    spec.observe_step(mixed, {"r0": [1], "r1": [1], prefill.request_id: [1]}, 0.1)
    assert spec.guard.speculating(2) is None and not spec.guard._sizes
    # speculative steps at 2 tokens a row in 0.3 s, plain at 1 token a row in 0.1 s: slower
    for _ in range(40):
        spec.before_schedule(reqs)
        drafts = {r.request_id: list(r.spec_token_ids) for r in reqs}
        sched = SchedulerOutput(scheduled=reqs, spec_token_ids=drafts,
                                num_scheduled_tokens={rid: 1 + len(d) for rid, d in drafts.items()})
        speculating = any(drafts.values())
        sampled = {rid: [1, 1] if speculating else [1] for rid in drafts}
        spec.observe_step(sched, sampled, 0.3 if speculating else 0.1)
    assert spec.guard.speculating(2) is False
    spec.before_schedule(reqs)
    assert all(not r.spec_token_ids for r in reqs)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    path, _ = tiny_model_factory("llama", num_hidden_layers=2)
    return path


def test_engine_stops_speculating_where_its_steps_are_slower(tiny_path):
    """Every step proposes (a proposer that always guesses), and speculative steps are made
    20 ms slower than any speedup could repay: after the warm-up the engine decodes without
    speculating (probes aside), and the tokens are those of no speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = _prompts()[:2]
    alone = LLM(tiny_path, block_size=4, num_kv_blocks=256, max_num_seqs=2)
    expected = [o.outputs[0].token_ids for o in alone.generate(prompts, params, use_tqdm=False)]

    llm = LLM(tiny_path, block_size=4, num_kv_blocks=256, max_num_seqs=2,
              speculative_method="ngram", num_speculative_tokens=4, num_decode_steps=1)
    engine = llm.engine
    engine.spec.min_acceptance, engine.spec.max_verify_rows = 0.0, None
    engine.spec.cost = None                 # every step proposes, whatever rows cost
    engine.spec.token_proposer = Repeat()
    execute = engine.runner.execute

    def slow_when_speculating(sched):
        if any(sched.spec_token_ids.values()):
            time.sleep(0.02)
        return execute(sched)
    engine.runner.execute = slow_when_speculating
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    guard = engine.spec.guard
    assert guard.speculating(2) is False
    assert guard.stats.denied_steps > 0
    # 48 tokens each: with speculation never vetoed, nearly every step would speculate
    assert engine.spec_stats.num_verify_steps < 0.5 * guard.stats.denied_steps
    engine.check_integrity()
    assert engine.num_free_blocks == engine.runner.num_blocks


def test_the_guard_is_on_by_default_and_the_flag_turns_it_off(tiny_path):
    from tests.helpers.cli import engine_config_from_flags
    assert engine_config_from_flags(["--speculative-method", "ngram"]).speculative_speed_guard
    assert not engine_config_from_flags(["--speculative-method", "ngram",
                                         "--no-speculative-speed-guard"]).speculative_speed_guard
    on = LLM(tiny_path, block_size=4, num_kv_blocks=64, speculative_method="ngram")
    off = LLM(tiny_path, block_size=4, num_kv_blocks=64, speculative_method="ngram",
              speculative_speed_guard=False)
    assert isinstance(on.engine.spec.guard, SpeedGuard) and off.engine.spec.guard is None
