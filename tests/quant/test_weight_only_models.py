"""Weight-only quantized models end to end: GGUF Q4_1 blocks run natively on the default
model, and save / reload of an INT4 model without requantizing."""
import pytest
import torch

from kvforge import LLM
from kvforge.loader.source import load_model_source
from kvforge.quant.gguf import GGUFLinearMethod
from kvforge.quant.int8 import Int8LinearMethod
from kvforge.quant.loading import load_model
from kvforge.quant.serialize import QUANT_FILE, read_saved_quantization, save_quantized
from kvforge.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1780, 253, 1115, 314, 253, 7089, 30]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _greedy(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks, "leaked KV blocks"
    return [o.outputs[0].token_ids for o in outs]


@torch.inference_mode()
def _logits(model, ids):
    from kvforge.attention.metadata import AttentionMetadata
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(-(-len(ids) // 16)))], 16, "cpu")
    caches = [torch.zeros(model.kv_cache_shape(-(-len(ids) // 16), 16))
              for _ in range(model.num_layers)]
    return model.compute_logits(model(torch.tensor(ids), meta.positions(), caches, meta))


@pytest.mark.slow
def test_gguf_q4_1_native_matches_dequantized_fp32(default_model_path):
    source = load_model_source(default_model_path)
    fp32 = load_model(source)
    native = load_model(source, quantization="gguf")
    layer = native.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.method, GGUFLinearMethod) and not hasattr(layer, "weight")
    assert [b.type_name for b in layer.gguf_blocks] == ["Q4_1"] * 3    # the file's blocks
    for ids in PROMPTS:
        a, b = _logits(native, ids), _logits(fp32, ids)
        # 8-bit activations (the head's input has outliers ~20x its rms): ~0.5 logit at most
        assert (a - b).norm() < 0.05 * b.norm()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
        assert agree >= 0.8, agree
    del fp32, native
    kw = dict(kv_cache_memory="32MiB", max_model_len=256)
    native_tokens = _greedy(LLM(default_model_path, quantization="gguf", **kw))
    fp32_tokens = _greedy(LLM(default_model_path, **kw))
    # equal up to a near tie: the first tokens agree
    assert [t[:2] for t in native_tokens] == [t[:2] for t in fp32_tokens]


def test_int4_save_reload_gives_identical_outputs(tiny_model_factory, tmp_path):
    hf_dir, _ = tiny_model_factory("llama")
    args = {"group_size": 32}
    source = load_model_source(hf_dir)
    model = load_model(source, quantization="int4", quantization_args=args)
    out = save_quantized(model, source, str(tmp_path / "q"))
    assert read_saved_quantization(out) == ("int4", {"group_size": 32, "lm_head": "int8"})
    reloaded = load_model(load_model_source(out))
    assert reloaded.quant_config.name == "int4"
    for (name, a), (_, b) in zip(model.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(a, b), name
    ids = PROMPTS[1]
    assert torch.equal(_logits(model, ids), _logits(reloaded, ids))
    kw = dict(kv_cache_memory="8MiB")
    assert _greedy(LLM(out, **kw)) == _greedy(LLM(hf_dir, quantization="int4",
                                                  quantization_args=args, **kw))
    with pytest.raises(ValueError, match="already quantized"):
        load_model(load_model_source(out), quantization="int8")
    assert (tmp_path / "q" / QUANT_FILE).is_file()


@pytest.mark.parametrize("tied", [False, True])
def test_int8_model_tracks_fp32_within_its_quantization_error(tiny_model_factory, tied):
    """Tied: the quantized head must load its own copy from the embedding.

    The model has peaked predictions (initializer_range 0.1: logits spread ~0.8, not the
    near-uniform ~0.16 of the default 0.02), and every bound is set by the quantization itself:
    each weight within half a step of its float value, and the int8 model's logits as close to
    the fp32 ones as the same model run in float with the dequantized int8 weights ("fake
    quant", the error weight rounding alone causes) -- the int8 kernel's bf16 activations add
    less than that again."""
    hf_dir, _ = tiny_model_factory("llama", tie_word_embeddings=tied, initializer_range=0.1)
    source = load_model_source(hf_dir)
    fp32, int8, fake_quant = (load_model(source), load_model(source, quantization="int8"),
                              load_model(source))
    fp32_modules, fake_modules = dict(fp32.named_modules()), dict(fake_quant.named_modules())
    num_int8 = 0
    with torch.no_grad():
        for name, module in int8.named_modules():
            if not isinstance(getattr(module, "method", None), Int8LinearMethod):
                continue
            num_int8 += 1
            dequantized = module.method.dequantize(module)
            # an all-zero row (the tied embedding's padding token) has scale 0 and no error
            steps = ((fp32_modules[name].weight - dequantized).abs()
                     / module.scales.float().clamp_min(1e-30)[:, None])
            assert steps.max() <= 0.5 + 1e-2, (name, float(steps.max()))
            fake_modules[name].weight.copy_(dequantized)
    assert num_int8 == 4 * fp32.num_layers + 1           # qkv, o, gate_up, down; the LM head

    ids = [int(i) for i in torch.randint(3, 49152, (64,), generator=torch.Generator().manual_seed(0))]
    ref, ours, fake = _logits(fp32, ids), _logits(int8, ids), _logits(fake_quant, ids)
    assert ref.std() > 0.5, "the test model's predictions should not be near uniform"
    rounding_error = (fake - ref).norm()
    assert 0 < rounding_error < 0.05 * ref.norm()
    assert (ours - ref).norm() < 1.5 * rounding_error, ((ours - ref).norm(), rounding_error)
    assert (ours - fake).norm() < rounding_error
    # greedy tokens: equal wherever fp32's top-2 margin exceeds twice the largest logit error
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * (ours - ref).abs().max()
    assert clear.sum() >= 8, "too few clear-cut positions to compare"
    assert torch.equal(ours.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_unknown_quantization_is_a_clear_error():
    from kvforge.config import EngineConfig
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3")
