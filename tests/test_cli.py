"""The CLI streams a generation and reports model facts."""
from __future__ import annotations

from kvforge import LLM, SamplingParams
from kvforge.cli import main


def test_generate_streams_same_text_as_api(tiny_model_factory, capsys):
    path, _ = tiny_model_factory("llama")
    rc = main(["generate", "Hello there", "--model", path, "--max-tokens", "7", "--num-kv-blocks",
               "64", "--no-chat-template"])
    assert rc == 0
    printed = capsys.readouterr().out
    expected = LLM(path, num_kv_blocks=64).generate(
        ["Hello there"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    assert printed.rstrip("\n") == expected[0].outputs[0].text


def test_info_reports_kv_bytes_per_token(default_model_path, capsys):
    assert main(["info", default_model_path]) == 0
    out = capsys.readouterr().out
    # SmolLM2: 30 layers x (K + V) x 3 kv heads x 64 dims x 4 bytes = 46080
    assert "46080 bytes per token" in out


def test_bad_model_path_is_a_clean_error(capsys, tmp_path):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing")])
    assert rc == 2
    assert "missing" in capsys.readouterr().err
