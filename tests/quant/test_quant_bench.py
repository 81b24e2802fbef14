"""benchmarks/quant.py: method specs parse to labels and arguments, and a short run prints a
table whose fp32 perplexity is HF transformers' over the same tokens, with int8 rows of fewer
weight bytes and nearly the same perplexity."""
import math
import os

import pytest

from benchmarks.quant import main, parse_method
from tests.helpers.hf_oracle import hf_perplexity

PPL_TOKENS = 128


def test_method_specs_parse_to_labels_and_arguments():
    assert parse_method("none") == ("fp32", "none", {})
    assert parse_method("awq:g128") == ("awq-g128", "awq", {"group_size": 128})
    assert parse_method("int4:g32:lm_head=int4") == (
        "int4-g32-lm_head=int4", "int4", {"group_size": 32, "lm_head": "int4"})
    assert parse_method("smoothquant:alpha=0.6") == ("smoothquant-alpha=0.6", "smoothquant",
                                                     {"alpha": 0.6})


def _table_rows(stdout: str) -> dict[str, list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method "))
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("SUMMARY"):
            cells = [c.strip() for c in line.split("|")]
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow
def test_short_run_reports_rows_that_agree_with_hf(capsys, hf_smollm):
    from kvforge.eval.corpus import load_corpus
    from kvforge.loader.source import load_model_source
    rc = main(["--methods", "none,int8,int3", "--ppl-tokens", f"{PPL_TOKENS // 2},{PPL_TOKENS}",
               "--skip-large", "--decode-tokens", "2", "--batch", "2", "--rounds", "1",
               "--num-threads", "2"])
    assert rc == 0
    out = capsys.readouterr()
    assert "default int3: skipped (ValueError: unknown quantization 'int3'" in out.err
    rows = _table_rows(out.out)
    assert set(rows) == {"fp32", "int8"}
    # columns: method, weights MiB, avg bits, load s, ppl@64, vs fp32, ppl@128, vs fp32,
    # b1 tok/s, b1 x, b2 tok/s, b2 x
    fp32, int8 = [rows[k][:4] + rows[k][6:] for k in ("fp32", "int8")]
    assert float(int8[1]) < 0.6 * float(fp32[1])
    # int8 codes plus one bf16 scale per 576- or 1536-wide row
    assert float(fp32[2]) == 32.0 and 8.0 < float(int8[2]) < 8.05

    ids = load_model_source(None).load_tokenizer().encode(load_corpus("shakespeare"),
                                                          add_special_tokens=False)
    hf_ppl, scored = hf_perplexity(hf_smollm, ids[:PPL_TOKENS], window=512)
    assert scored == PPL_TOKENS - 1
    assert math.isclose(float(fp32[4]), hf_ppl, rel_tol=2e-3), (fp32[4], hf_ppl)
    half_ppl, _ = hf_perplexity(hf_smollm, ids[:PPL_TOKENS // 2], window=512)
    assert math.isclose(float(rows["fp32"][4]), half_ppl, rel_tol=2e-3)    # the prefix's
    # int8 weights move a 135M model's perplexity by well under 5%
    assert abs(float(int8[4]) / float(fp32[4]) - 1) < 0.05, (int8[4], fp32[4])
    assert fp32[5] == "+0.00%" and fp32[7] == "1.00x"
    assert float(fp32[6]) > 0 and float(int8[8]) > 0
    assert "SUMMARY quant default: fp32:b1=1.00x" in out.out


def test_a_native_gguf_model_reports_its_blocks_bytes_and_bits():
    """The default file runs in its own Q4_1 blocks (buffers over the mapped file; only the
    norms are parameters): its size is the blocks' bytes and its projections 5.0 bits a weight
    (20 bytes per 32), the Q8_0 embedding left out as other methods' embeddings are."""
    from kvforge import LLM
    from kvforge.loader.default_model import default_model_path
    from kvforge.quant.bits import average_bits
    from kvforge.quant.loading import weight_bytes
    model = LLM(num_kv_blocks=16).engine.runner.model
    floats = sum(p.numel() * p.element_size() for p in model.parameters())    # the norms
    assert average_bits(model) == pytest.approx(5.0)
    size = os.path.getsize(default_model_path())
    assert floats < 0.01 * size < 0.9 * size < weight_bytes(model) <= size + floats
