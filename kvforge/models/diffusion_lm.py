"""Masked-diffusion LMs (LLaDA, Dream): a Llama-shaped pre-norm transformer whose attention is
bidirectional; generation (``kvforge/diffusion``) fills a canvas of mask tokens over steps.

Two checkpoint layouts, one module tree (HF Qwen2 names, which Dream uses as they are):
  LLaDA  model.transformer.wte / blocks.N.{q,k,v}_proj, attn_out, ff_proj (gate), up_proj,
         ff_out (down), attn_norm, ff_norm / ln_f / ff_out (LM head); config d_model, n_heads ...
  Dream  Qwen2's names and config (q/k/v biases); the model predicts token i at position i - 1
         (it starts from an autoregressive Qwen2), so its logits are shifted right by one.

Plain torch layers, so the same module trains (``kvforge train-diffusion``) and generates. The
K/V cache is the whole canvas per layer (``DiffusionKVCache``), not the paged pool: a diffusion
step recomputes query spans in the middle of a sequence, which the engine's append-only block
tables do not describe.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from kvforge.kernels import ops as kernel_ops
from kvforge.layers.rotary import compute_inv_freq
from kvforge.models.diffusion_config import DiffusionLMConfig

# LLaDA checkpoint name parts -> ours (Qwen2 / Dream names)
_LLADA_NAMES = (("model.transformer.wte.", "model.embed_tokens."),
                ("model.transformer.ln_f.", "model.norm."),
                ("model.transformer.ff_out.", "lm_head."),
                ("model.transformer.blocks.", "model.layers."),
                (".attn_norm.", ".input_layernorm."), (".ff_norm.", ".post_attention_layernorm."),
                (".q_proj.", ".self_attn.q_proj."), (".k_proj.", ".self_attn.k_proj."),
                (".v_proj.", ".self_attn.v_proj."), (".attn_out.", ".self_attn.o_proj."),
                (".ff_proj.", ".mlp.gate_proj."), (".up_proj.", ".mlp.up_proj."),
                (".ff_out.", ".mlp.down_proj."))


class DiffusionKVCache:
    """K/V of every canvas position per layer, [B, KVH, L, D], from the last full forward (a
    refresh). A partial forward over positions [start, end) writes its fresh K/V over that span
    and attends to the whole tensor (Fast-dLLM's approximate cache):

        keys = cache[:, :, :start] | fresh span | cache[:, :, end:]
               (prefix cache: end = L, no suffix; dual cache: end = block end)

    Writing in place is exact, not a shortcut: until the next refresh every partial forward
    covers the same span, so a span position's cached K/V is never read before it is rewritten.
    """

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def attend_keys(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int,
                    refresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if refresh:
            self.keys[layer], self.values[layer] = k, v
            return k, v
        ck, cv = self.keys[layer], self.values[layer]
        if ck is None:
            raise ValueError("a partial forward needs a refreshed cache first")
        end = start + k.shape[2]
        ck[:, :, start:end] = k
        cv[:, :, start:end] = v
        return ck, cv


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX ("rotate_half") RoPE of x [T, heads, D] with the [cos | cos] and [-sin | sin]
    tables [T, 1, D]. Generation takes the compiled kernel; training (autograd) the torch form."""
    if torch.is_grad_enabled():
        return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
    return kernel_ops.rotary_neox(x, cos, sin)


def _norm(norm: nn.RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None):
    """``norm(x + residual)`` and ``x + residual``, fused by the compiled kernel when no
    gradient is wanted (nn.RMSNorm's ATen op costs ~35 us on a 32 x 256 block)."""
    if torch.is_grad_enabled():
        total = x if residual is None else x + residual
        return norm(total), total
    return kernel_ops.add_rms_norm(x, residual, norm.weight, norm.eps)


class DiffusionAttention(nn.Module):
    def __init__(self, cfg: DiffusionLMConfig, index: int) -> None:
        super().__init__()
        self.index, self.heads, self.kv_heads, self.head_dim = (index, cfg.num_heads,
                                                                cfg.num_kv_heads, cfg.head_dim)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, key_mask, cache: DiffusionKVCache | None, start: int,
                refresh: bool) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = _rotate(self.q_proj(x).view(b * q_len, self.heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(b * q_len, self.kv_heads, self.head_dim), cos, sin)
        q = q.view(b, q_len, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.attend_keys(self.index, k, v, start, refresh)
        # no causal mask: every position sees the whole canvas (minus left padding)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DiffusionBlock(nn.Module):
    def __init__(self, cfg: DiffusionLMConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DiffusionAttention(cfg, index)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, key_mask, cache, start, refresh):
        h, _ = _norm(self.input_layernorm, x)
        h, x = _norm(self.post_attention_layernorm,
                     self.self_attn(h, cos, sin, key_mask, cache, start, refresh), x)
        mlp = self.mlp
        return x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class MaskedDiffusionLM(nn.Module):
    def __init__(self, cfg: DiffusionLMConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DiffusionBlock(cfg, i) for i in range(cfg.num_layers))
        self.model.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", compute_inv_freq(cfg.head_dim, cfg.rope_theta)[0],
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                key_mask: torch.Tensor | None = None, cache: DiffusionKVCache | None = None,
                start: int = 0, refresh: bool = False,
                logit_rows: slice | None = None) -> torch.Tensor:
        """[B, Q] ids at [B, Q] positions -> [B, Q, V] fp32 logits (only ``logit_rows`` of the
        Q when given). ``key_mask`` [B, 1, 1, K] (True = visible) hides left padding; with
        ``cache``, ``refresh`` stores this forward's K/V (Q must be the whole canvas) and
        otherwise the query span starts at canvas position ``start``."""
        # per token [T = B * Q, 1, D]: [cos | cos] and [-sin | sin] (layers/rotary.py's tables)
        angles = positions.reshape(-1, 1).float() * self.inv_freq
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).unsqueeze(1)
        sin = torch.cat((-angles.sin(), angles.sin()), dim=-1).unsqueeze(1)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, key_mask, cache, start, refresh)
        if logit_rows is not None:
            x = x[:, logit_rows]
        return self.lm_head(_norm(self.model.norm, x)[0]).float()

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """Fresh weights for training: N(0, std), output projections scaled by depth."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    scale = (2 * self.config.num_layers) ** -0.5 if (
                        "o_proj" in name or "down_proj" in name) else 1.0
                    p.normal_(0.0, std * scale, generator=generator)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF tensors in either layout; refuses unknown names, bad shapes and missing tensors."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self.config.layout == "llada":
                for old, new in _LLADA_NAMES:
                    name = name.replace(old, new)
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.layout} "
                                 f"diffusion model")
            if param.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {sorted(missing)[:10]}")

    def llada_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under LLaDA's checkpoint names (the inverse of the loader's renaming)."""
        out = {}
        for name, tensor in self.state_dict().items():
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            for old, new in reversed(_LLADA_NAMES):
                name = name.replace(new, old)
            out[name] = tensor.contiguous()
        return out


def load_diffusion_model(source) -> MaskedDiffusionLM:
    """A ``loader.source.ModelSource`` of a diffusion architecture -> the model, eval mode,
    gradients off."""
    cfg = DiffusionLMConfig.from_hf_dict(source.config.hf_config)
    model = MaskedDiffusionLM(cfg)
    model.load_weights(source.iter_weights())
    return model.eval().requires_grad_(False)
