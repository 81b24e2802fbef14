"""Exit heads: shapes and layer validation, safetensors + json round trip, found by model file,
and a short distillation that lowers the KL to the full model."""
from __future__ import annotations

import pytest
import torch

from kvforge.exit.heads import ExitHeads, default_exit_layers, validate_exit_layers
from kvforge.exit.store import heads_dir, load_heads, load_heads_for
from tests.exit.conftest import NUM_LAYERS


def test_default_layers_for_30_layers():
    assert default_exit_layers(30) == [8, 15, 19, 22]
    assert all(1 <= e < 4 for e in default_exit_layers(4))


@pytest.mark.parametrize("layers", [[0], [NUM_LAYERS], [-1, 2], []])
def test_bad_layers_are_refused(layers):
    with pytest.raises(ValueError, match="exit layers|no exit layers"):
        validate_exit_layers(layers, NUM_LAYERS)


def test_untrained_head_is_the_final_norm(tiny_fp32):
    _, model = tiny_fp32
    heads = ExitHeads.for_model(model, [2])
    x = torch.randn(5, model.config.hidden_size)
    torch.testing.assert_close(heads[2](x), model.model.norm(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError, match="no exit head after layer 3"):
        heads[3]


def test_save_load_round_trip(tiny_path, tiny_fp32, saved_heads):
    _, model = tiny_fp32
    loaded, config = load_heads(heads_dir(tiny_path))
    assert loaded.layers == [1, 2] and config["test"] is True
    for name, t in saved_heads.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    found = load_heads_for(model, tiny_path)
    x = torch.randn(3, model.config.hidden_size)
    assert torch.equal(found[1](x), saved_heads[1](x))


def test_missing_heads_say_how_to_train(tiny_fp32, tmp_path):
    _, model = tiny_fp32
    with pytest.raises(FileNotFoundError, match="kvforge train-exit-heads"):
        load_heads(tmp_path / "nothing")


def test_short_training_lowers_kl(tiny_fp32):
    from kvforge.exit.train import ExitTraining, collect_streams, train_heads
    _, model = tiny_fp32
    ids = torch.randint(3, model.config.vocab_size, (96,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    streams, final = collect_streams(model, ids, [1, 2], window=32, progress=False)
    assert streams[1].shape == final.shape == (96, model.config.hidden_size)
    heads = ExitHeads.for_model(model, [1, 2])
    report = train_heads(model, heads, streams, final,
                         ExitTraining(epochs=4, batch=16, lr=3e-3), progress=False)
    for e in (1, 2):
        assert report["after"][e]["kl"] < report["before"][e]["kl"], report
    assert not any(p.requires_grad for p in heads.parameters())
