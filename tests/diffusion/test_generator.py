"""The diffusion loop: LLaDA's published generate as oracle, threshold and cache invariants,
batching, and parameters refused."""
from __future__ import annotations

import pytest
import torch

from kvforge.diffusion.generator import DiffusionGenerator
from kvforge.sampling_params import SamplingParams
from tests.diffusion import llada_reference
from tests.diffusion.factories import MASK_ID, tiny_model

PROMPT = [5, 17, 3, 42, 8, 11, 29]


def params(max_tokens=16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def run(model, prompts, **kw):
    return DiffusionGenerator(model).generate(prompts, params(**kw))


@pytest.mark.parametrize("gen_length,block_length,steps", [(16, 16, 16), (16, 4, 16), (16, 8, 8),
                                                           (24, 8, 12)])
def test_matches_llada_generate_token_for_token(gen_length, block_length, steps):
    model = tiny_model()
    ours = run(model, [PROMPT], max_tokens=gen_length, diffusion_block_length=block_length,
               diffusion_steps=steps)
    ref = llada_reference.generate(model, torch.tensor([PROMPT]), steps=steps,
                                   gen_length=gen_length, block_length=block_length,
                                   mask_id=MASK_ID)
    assert ours.token_ids[0] == ref[0, len(PROMPT):].tolist()
    assert MASK_ID not in ours.token_ids[0]
    assert ours.stats.forwards == steps


def test_matches_llada_generate_for_a_batch():
    model = tiny_model(seed=1)
    prompts = [PROMPT, [9, 1, 4, 4, 30, 2, 7]]
    ours = run(model, prompts, max_tokens=16, diffusion_block_length=8)
    ref = llada_reference.generate(model, torch.tensor(prompts), steps=16, gen_length=16,
                                   block_length=8, mask_id=MASK_ID)
    assert ours.token_ids == ref[:, len(PROMPT):].tolist()


def test_threshold_one_is_one_token_per_step():
    model = tiny_model(seed=2)
    fixed = run(model, [PROMPT], max_tokens=16, diffusion_block_length=8)
    tau_one = run(model, [PROMPT], max_tokens=16, diffusion_block_length=8,
                  parallel_threshold=1.0)
    assert tau_one.token_ids == fixed.token_ids
    assert tau_one.stats.forwards == fixed.stats.forwards == 16


def test_low_threshold_commits_several_tokens_per_step():
    model = tiny_model(seed=2)
    fast = run(model, [PROMPT], max_tokens=16, diffusion_block_length=8, parallel_threshold=0.05)
    assert fast.stats.forwards < 16
    assert MASK_ID not in fast.token_ids[0]


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("layout", ["llada", "dream"])
def test_cache_on_equals_off_when_every_step_is_a_refresh(mode, layout):
    # one step per block: every forward is the block's refresh, so the cache is never stale
    model = tiny_model(layout, seed=3)
    off = run(model, [PROMPT, PROMPT[:4]], max_tokens=16, diffusion_block_length=4,
              diffusion_steps=4)
    on = run(model, [PROMPT, PROMPT[:4]], max_tokens=16, diffusion_block_length=4,
             diffusion_steps=4, diffusion_cache=mode)
    assert on.token_ids == off.token_ids
    assert on.stats.forwards == off.stats.forwards == 4


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_partial_forward_equals_full_forward_at_refresh(mode):
    # right after a refresh nothing has changed, so the partial forward over the cache must
    # give the full forward's logits for the block
    from kvforge.models.diffusion_lm import DiffusionKVCache
    model = tiny_model(seed=4)
    canvas = torch.tensor([PROMPT + [MASK_ID] * 12])
    positions = torch.arange(canvas.shape[1]).unsqueeze(0)
    s, e = len(PROMPT) + 4, len(PROMPT) + 8
    cache = DiffusionKVCache(model.config.num_layers)
    full = model(canvas, positions, cache=cache, refresh=True)
    end = canvas.shape[1] if mode == "prefix" else e
    part = model(canvas[:, s:end], positions[:, s:end], cache=cache, start=s)
    torch.testing.assert_close(part[:, :e - s], full[:, s:e], rtol=1e-5, atol=1e-5)


def test_cache_reduces_computed_positions_and_stays_close():
    model = tiny_model(seed=5)
    off = run(model, [PROMPT], max_tokens=16, diffusion_block_length=8)
    dual = run(model, [PROMPT], max_tokens=16, diffusion_block_length=8, diffusion_cache="dual")
    assert dual.stats.query_tokens < off.stats.query_tokens / 2
    assert MASK_ID not in dual.token_ids[0]


@pytest.mark.parametrize("layout", ["llada", "dream"])
def test_padded_batch_rows_equal_their_single_runs(layout):
    model = tiny_model(layout, seed=6)
    prompts = [PROMPT, [4, 9], [12, 1, 33, 7]]
    batch = run(model, prompts, max_tokens=8, diffusion_block_length=4)
    for row, prompt in enumerate(prompts):
        assert batch.token_ids[row] == run(model, [prompt], max_tokens=8,
                                           diffusion_block_length=4).token_ids[0]


@pytest.mark.parametrize("remasking", ["random", "entropy", "margin"])
def test_other_remasking_fill_the_canvas(remasking):
    model = tiny_model(seed=7)
    out = run(model, [PROMPT], max_tokens=12, diffusion_block_length=4, remasking=remasking)
    assert MASK_ID not in out.token_ids[0] and len(out.token_ids[0]) == 12


def test_temperature_sampling_is_seeded_and_differs_from_greedy():
    model = tiny_model(seed=8)
    p = SamplingParams(temperature=1.0, max_tokens=16, diffusion_block_length=8)
    gen = DiffusionGenerator(model)

    def sample(seed):
        return gen.generate([PROMPT], p, [torch.Generator().manual_seed(seed)]).token_ids

    assert sample(1) == sample(1)
    assert sample(1) != sample(2) or sample(1) != run(model, [PROMPT], max_tokens=16,
                                                      diffusion_block_length=8).token_ids


def test_last_block_may_be_shorter():
    model = tiny_model(seed=9)
    out = run(model, [PROMPT], max_tokens=10, diffusion_block_length=4, diffusion_steps=9)
    assert len(out.token_ids[0]) == 10 and MASK_ID not in out.token_ids[0]


@pytest.mark.parametrize("kwargs,message", [
    (dict(diffusion_steps=0), "diffusion_steps must be None or an integer >= 1, got 0"),
    (dict(diffusion_block_length=0), "diffusion_block_length must be an integer >= 1, got 0"),
    (dict(remasking="lowest"), "got 'lowest'"),
    (dict(diffusion_cache="both"), "got 'both'"),
    (dict(parallel_threshold=0.0), "parallel_threshold must be in (0, 1], got 0.0"),
    (dict(parallel_threshold=1.5), "got 1.5"),
    (dict(parallel_threshold=0.9, remasking="random"), "got 'random'"),
    (dict(parallel_threshold=0.9, diffusion_steps=8), "got 8"),
])
def test_bad_parameters_refused(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=16, diffusion_steps=17), "diffusion_steps (17) must be <= max_tokens (16)"),
    (dict(max_tokens=16, diffusion_block_length=4, diffusion_steps=6),
     "diffusion_steps (6) must be a multiple of the number of blocks (4"),
])
def test_bad_schedules_refused(kwargs, message):
    with pytest.raises(ValueError) as err:
        run(tiny_model(), [PROMPT], **kwargs)
    assert message in str(err.value)


def test_empty_prompt_and_overlong_canvas_refused():
    model = tiny_model()
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(model, [[]])
    with pytest.raises(ValueError, match="exceeds the model's 256 positions"):
        run(model, [PROMPT], max_tokens=250)


class _ConcatCache:
    """Fast-dLLM's cache as written: a partial forward attends to cat(cache, fresh span,
    cache) and the cache is never written between refreshes."""

    def attend_keys(self, layer, k, v, start, refresh):
        if refresh:
            self.keys[layer], self.values[layer] = k.clone(), v.clone()
            return k, v
        ck, cv = self.keys[layer], self.values[layer]
        end = start + k.shape[2]
        return (torch.cat((ck[:, :, :start], k, ck[:, :, end:]), dim=2),
                torch.cat((cv[:, :, :start], v, cv[:, :, end:]), dim=2))


@pytest.mark.parametrize("mode", ["prefix", "dual"])
@pytest.mark.parametrize("layout", ["llada", "dream"])
def test_in_place_cache_equals_concatenated_cache_between_refreshes(mode, layout, monkeypatch):
    from kvforge.models import diffusion_lm
    model = tiny_model(layout, seed=10)
    kw = dict(max_tokens=16, diffusion_block_length=8, diffusion_cache=mode)
    ours = run(model, [PROMPT, PROMPT[:3]], **kw)
    monkeypatch.setattr(diffusion_lm.DiffusionKVCache, "attend_keys", _ConcatCache.attend_keys)
    reference = run(model, [PROMPT, PROMPT[:3]], **kw)
    assert ours.token_ids == reference.token_ids
    assert ours.stats.forwards == reference.stats.forwards == 16
