"""Tensor parallel over a GGUF file's own blocks (no dequantization): a K-quant Qwen2 (q/k/v
biases, tied Q8_0 embedding, Q4_K and Q6_K projections, an MLP of 3 blocks split 2 + 1) gives
TP=1's tokens at TP=2, and each rank holds block slices of the file, not fp32 copies."""
from __future__ import annotations

import zlib

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants

import transformers as tf
from kvforge import LLM, SamplingParams
from kvforge.distributed.tp_model import _columns
from kvforge.quant.gguf import GGUFBlocks, GGUFLinearMethod
from tests.helpers.hf_oracle import TINY_BASE
from tests.kernels.test_cpu_kernels import needs_kernels
from tests.kernels.test_gguf_kernels import random_blocks
from tests.loader.gguf_factory import gpt2_bpe_tokenizer, write_hf_model_gguf

HIDDEN, MLP = 512, 768             # 2 and 3 blocks of 256: heads split 1 + 1 blocks, MLP 2 + 1
PROMPTS = [[5, 6, 7, 100, 2000], list(range(10, 47)), [300 + 7 * i for i in range(19)]]
ENGINE = dict(block_size=4, num_kv_blocks=96, max_num_batched_tokens=16, num_threads=1)


def _kquant(name: str, arr):
    """Projections as random valid K-quant blocks (Q6_K where Q4_K_M files keep it), the tied
    embedding in Q8_0, norms and biases in F32."""
    if arr.ndim != 2:
        return arr, QT.F32
    if name.startswith("token_embd"):
        return quants.quantize(arr, QT.Q8_0), QT.Q8_0
    qtype = QT.Q6_K if name.split(".")[2] in ("ffn_down", "attn_output") else QT.Q4_K
    return random_blocks(qtype, *arr.shape, seed=zlib.crc32(name.encode()),
                         scales=(2e-5, 2e-4)), qtype


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory, tokenizer_dir) -> str:
    torch.manual_seed(0)
    config = tf.Qwen2Config(**{**TINY_BASE, "hidden_size": HIDDEN, "intermediate_size": MLP,
                               "tie_word_embeddings": True})
    hf = tf.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = str(tmp_path_factory.mktemp("tp_gguf") / "tiny-qwen2-kquant.gguf")
    write_hf_model_gguf(path, hf, "qwen2", encode=_kquant, tokenizer=gpt2_bpe_tokenizer(
        tf.AutoTokenizer.from_pretrained(tokenizer_dir), pre="qwen2"))
    return path


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@needs_kernels
@pytest.mark.slow
def test_tp2_on_kquant_blocks_equals_tp1(kquant_gguf):
    reference = _tokens(LLM(kquant_gguf, **ENGINE))
    assert len({t for seq in reference for t in seq}) > 5     # not a model stuck on one token
    llm = LLM(kquant_gguf, **ENGINE, tensor_parallel_size=2)
    try:
        layer = llm.engine.runner.model.model.layers[0]
        down, o_proj = layer.mlp.down_proj, layer.self_attn.o_proj
        # rank 0's row-parallel slices: whole blocks of the file's rows, still Q6_K
        assert isinstance(down.method, GGUFLinearMethod)
        assert [(b.type_name, b.shape) for b in down.gguf_blocks] == [("Q6_K", (HIDDEN, 512))]
        assert [(b.type_name, b.shape) for b in o_proj.gguf_blocks] == [("Q6_K", (HIDDEN, 256))]
        assert [b.type_name for b in layer.mlp.gate_up_proj.gguf_blocks] == ["Q4_K", "Q4_K"]
        assert layer.mlp.gate_up_proj.output_size == 2 * 512
        assert _tokens(llm) == reference
        llm.engine.check_integrity()
        assert llm.engine.num_free_blocks == llm.engine.runner.num_blocks
    finally:
        llm.engine.shutdown()


def test_columns_off_the_blocks_fall_back_to_fp32_rows():
    """A head boundary inside a 256-wide block: that slice is dequantized, values exact."""
    raw = torch.from_numpy(random_blocks(QT.Q4_K, 8, 512, seed=3))
    blocks = GGUFBlocks(raw, "Q4_K", 512, "blk.0.attn_output.weight")
    sliced = _columns(blocks, slice(128, 384))
    assert sliced.type_name == "F32" and sliced.shape == (8, 256)
    torch.testing.assert_close(sliced.dequantize(), blocks.dequantize()[:, 128:384],
                               rtol=0, atol=0)
    aligned = _columns(blocks, slice(256, 512))
    assert aligned.type_name == "Q4_K"
    torch.testing.assert_close(aligned.dequantize(), blocks.dequantize()[:, 256:],
                               rtol=0, atol=0)


@needs_kernels
def test_ranks_get_the_drivers_tile_crossover(kquant_gguf, monkeypatch):
    """The rows from which GGUF blocks leave the dot kernels, and for which many-row kernel, are
    chosen once, by rank 0, and handed to every worker; a float model hands nothing."""
    from kvforge.config import EngineConfig
    from kvforge.distributed.tp_model import tensor_parallel_quantization
    from kvforge.distributed.tp_runner import _shared_choices
    from kvforge.loader.source import load_model_source
    source = load_model_source(kquant_gguf)

    def choices(config: EngineConfig) -> dict[str, str]:
        return _shared_choices(tensor_parallel_quantization(
            config.quantization, source, config.torch_dtype, config.device), source)

    from kvforge.kernels.gguf_tiles import BLOCK_TYPES
    types = sorted({t.tensor_type.name for t in source.gguf_reader().tensors} & set(BLOCK_TYPES))
    assert "Q4_K" in types, "the fixture holds K-quant blocks"
    monkeypatch.setenv("KVFORGE_TUNE", "0")
    monkeypatch.delenv("KVFORGE_GGUF_GEMM_KERNEL", raising=False)
    # not measured: int8 panels for every type with a panel form, fp32 tiles for Q8_0
    kernels = ",".join(f"{t}={'tiles' if t == 'Q8_0' else 'panels'}" for t in types)
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_ROWS", "96")
    config = EngineConfig(model=kquant_gguf, tensor_parallel_size=2)
    assert choices(config) == {"KVFORGE_GGUF_GEMM_ROWS": ",".join(f"{t}=96" for t in types),
                               "KVFORGE_GGUF_GEMM_KERNEL": kernels}
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_ROWS", "Q6_K=48,96")
    monkeypatch.setenv("KVFORGE_GGUF_GEMM_KERNEL", "Q4_K=tiles")
    assert choices(config) == {
        "KVFORGE_GGUF_GEMM_ROWS": ",".join(f"{t}={48 if t == 'Q6_K' else 96}" for t in types),
        "KVFORGE_GGUF_GEMM_KERNEL": kernels.replace("Q4_K=panels", "Q4_K=tiles")}
    monkeypatch.delenv("KVFORGE_GGUF_GEMM_ROWS")
    monkeypatch.delenv("KVFORGE_GGUF_GEMM_KERNEL")
    assert choices(config) == {"KVFORGE_GGUF_GEMM_ROWS": ",".join(f"{t}=0" for t in types),
                               "KVFORGE_GGUF_GEMM_KERNEL": kernels}
    float_config = EngineConfig(model=kquant_gguf, tensor_parallel_size=2, quantization="none")
    assert choices(float_config) == {}
