"""The CLI: train-exit-heads trains and caches heads (a few steps on a tiny model), refuses an
unknown layer; eval perplexity with --early-exit-threshold prints the layers skipped."""
from __future__ import annotations

from kvforge.cli import main
from kvforge.exit.store import heads_dir, load_heads


def test_train_then_eval_perplexity(tiny_path, capsys):
    rc = main(["train-exit-heads", "--model", tiny_path, "--layers", "1", "2", "--tokens", "96",
               "--batch", "32"])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "saved to" in out and "top-1 agree" in out
    heads, config = load_heads(heads_dir(tiny_path))
    assert heads.layers == [1, 2] and config["tokens"] == 96
    rc = main(["eval", "perplexity", tiny_path, "--max-tokens", "64", "--window", "32",
               "--early-exit-threshold", "1e-6"])
    assert rc == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    # every position leaves at the head after layer 1 of 4
    assert "perplexity" in out and "layers skipped: 75.0%" in out


def test_unknown_layer_is_a_clean_error(tiny_path, capsys):
    assert main(["train-exit-heads", tiny_path, "--layers", "4"]) == 2
    assert "exit layers must be in [1, 3]" in capsys.readouterr().err
