"""eval.perplexity() and ``kvforge eval perplexity`` against HF transformers' loss over the same
windows, on a tiny model scoring its own greedy text (random ids would score near-uniformly
whatever the model computes)."""
from __future__ import annotations

import math
import re

import pytest

from kvforge.cli import main
from kvforge.eval.perplexity import perplexity
from kvforge.loader.source import load_model_source
from kvforge.quant.loading import load_model
from tests.helpers.hf_oracle import hf_greedy, hf_perplexity


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    path, hf_model = tiny_model_factory("llama", initializer_range=0.1)
    prompt = [1, 504, 3458, 282, 4649, 314]
    continuation, _ = hf_greedy(hf_model, prompt, 90, top_k=1)
    return path, hf_model, prompt + continuation


def test_perplexity_equals_hf_over_the_same_windows(tiny):
    path, hf_model, ids = tiny
    model = load_model(load_model_source(path))
    result = perplexity(model, ids, max_tokens=70, window=32, progress=False)
    # windows of 32, 32 and 6 tokens: each scores all but its first token
    assert (result.num_windows, result.num_scored) == (3, 31 + 31 + 5)
    expected, scored = hf_perplexity(hf_model, ids[:70], window=32)
    assert scored == result.num_scored
    assert math.isclose(result.perplexity, expected, rel_tol=1e-4), (result, expected)
    assert math.isclose(result.mean_nll, math.log(expected), rel_tol=1e-4)
    # the model's own greedy text: far more likely than uniform over its 49152 tokens
    assert result.perplexity < 49152 / 4


def test_chunked_windows_score_like_one_prefill(tiny):
    """Forwards of 5 tokens over the same cache (decode-size steps) give the prefill's NLL."""
    path, _, ids = tiny
    model = load_model(load_model_source(path))
    whole = perplexity(model, ids, max_tokens=70, window=32, progress=False)
    chunked = perplexity(model, ids, max_tokens=70, window=32, progress=False, chunk=5)
    assert chunked.num_scored == whole.num_scored
    assert math.isclose(chunked.mean_nll, whole.mean_nll, rel_tol=1e-5)
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        perplexity(model, ids, chunk=0)


def test_bad_arguments_are_clear_errors(tiny):
    path, _, ids = tiny
    model = load_model(load_model_source(path))
    with pytest.raises(ValueError, match="window must be >= 2, got 4096, 1"):
        perplexity(model, ids, window=1)
    with pytest.raises(ValueError, match="only 1 tokens"):
        perplexity(model, ids[:1], progress=False)


def test_cli_prints_the_perplexity_of_a_text_file(tiny, tmp_path, capsys):
    path, hf_model, ids = tiny
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Full fathom five thy father lies; of his bones are coral made. " * 6,
                      encoding="utf-8")
    rc = main(["eval", "perplexity", path, "--corpus", str(corpus), "--max-tokens", "50",
               "--window", "20", "--num-threads", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    m = re.fullmatch(r"perplexity ([\d.]+) \(mean NLL ([\d.]+)\) over (\d+) tokens in (\d+) "
                     r"windows; corpus (\S+), quantization none\n", out)
    assert m, out
    from transformers import AutoTokenizer
    tokens = AutoTokenizer.from_pretrained(path)(corpus.read_text(encoding="utf-8"),
                                                 add_special_tokens=False)["input_ids"]
    expected, scored = hf_perplexity(hf_model, tokens[:50], window=20)
    assert (int(m[3]), int(m[4]), m[5]) == (scored, 3, str(corpus))
    assert math.isclose(float(m[1]), expected, rel_tol=1e-3), (m[1], expected)


def test_cli_unknown_corpus_is_a_clean_error(tiny, capsys):
    path, _, _ = tiny
    assert main(["eval", "perplexity", path, "--corpus", "no-such-corpus"]) == 2
    assert "unknown corpus 'no-such-corpus'" in capsys.readouterr().err
