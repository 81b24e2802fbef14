"""RoPE tables and rotation vs HF transformers' rope functions (the oracle)."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvforge.layers.rotary import RotaryEmbedding, compute_inv_freq

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def hf_rotary(head_dim: int, base: float, scaling: dict | None, max_pos: int) -> LlamaRotaryEmbedding:
    params = {"rope_type": "default", "rope_theta": base, **(scaling or {})}
    cfg = tf.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_pos, rope_parameters=params)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_matches_hf(name):
    ours, scaling = compute_inv_freq(64, 5e5, SCALINGS[name], max_position_embeddings=512)
    ref = hf_rotary(64, 5e5, SCALINGS[name], 512)
    torch.testing.assert_close(ours, ref.inv_freq, rtol=0, atol=0)
    assert scaling == ref.attention_scaling


@pytest.mark.parametrize("name", ["default", "linear", "llama3"])
def test_rotation_matches_hf_apply_rotary_pos_emb(name):
    head_dim, max_pos = 32, 512
    ref = hf_rotary(head_dim, 1e4, SCALINGS[name], max_pos)
    ours = RotaryEmbedding(head_dim, max_position=max_pos, base=1e4, rope_scaling=SCALINGS[name])
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 63, 64, 300, 511, 5])      # unsorted, repeated
    q = torch.randn(len(positions), 6, head_dim, generator=g)
    k = torch.randn(len(positions), 2, head_dim, generator=g)
    cos, sin = ref(q, positions[None])                             # [1, T, D]
    # HF wants [batch, heads, T, D]
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours(positions, q), q_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours(positions, k), k_ref[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_position_zero_is_identity_and_norms_are_kept():
    rope = RotaryEmbedding(16, max_position=128, base=1e4)
    x = torch.randn(3, 2, 16)
    out = rope(torch.tensor([0, 17, 127]), x)
    torch.testing.assert_close(out[0], x[0])
    assert not torch.allclose(out[1], x[1])
    # each (x1[i], x2[i]) pair is rotated, so its length is unchanged
    pair_norm = lambda t: t[..., :8] ** 2 + t[..., 8:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(x))


def test_partial_rotary_rotates_only_the_leading_dims():
    full = RotaryEmbedding(8, max_position=64, base=1e4)
    partial = RotaryEmbedding(12, rotary_dim=8, max_position=64, base=1e4)
    x = torch.randn(4, 3, 12)
    pos = torch.tensor([3, 9, 0, 40])
    out = partial(pos, x)
    torch.testing.assert_close(out[..., :8], full(pos, x[..., :8].contiguous()))
    torch.testing.assert_close(out[..., 8:], x[..., 8:])


def test_non_contiguous_input_view():
    # the model rotates a strided view of the fused qkv output
    rope = RotaryEmbedding(16, max_position=64, base=1e4)
    qkv = torch.randn(5, 4 * 16 + 2 * 16 * 2)
    view = qkv[:, : 6 * 16].view(5, 6, 16)
    pos = torch.arange(5)
    torch.testing.assert_close(rope(pos, view), rope(pos, view.contiguous()))


@pytest.mark.parametrize("bad, match", [
    ({"rope_type": "yarn", "factor": 2.0}, "yarn"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
     "high_freq_factor"),
])
def test_bad_scaling_raises(bad, match):
    with pytest.raises(ValueError, match=match):
        compute_inv_freq(64, 1e4, bad)


def test_bad_dims_raise():
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(16, rotary_dim=20)
    with pytest.raises(ValueError, match="7"):
        compute_inv_freq(7, 1e4)


def test_old_style_type_key_is_understood():
    default, _ = compute_inv_freq(32, 1e4, None)
    linear, _ = compute_inv_freq(32, 1e4, {"type": "linear", "factor": 4.0})
    torch.testing.assert_close(linear, default / 4.0)
