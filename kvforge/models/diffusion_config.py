"""Hyper-parameters of a masked-diffusion LM (``diffusion_lm.py``), validated, from either
published config.json: LLaDA's (OLMo names) or Dream's (Qwen2 names + ``mask_token_id``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> checkpoint layout
DIFFUSION_LAYOUTS = {"LLaDAModelLM": "llada", "DreamModel": "dream"}


def is_diffusion_architecture(architecture: str) -> bool:
    return architecture in DIFFUSION_LAYOUTS


@dataclass
class DiffusionLMConfig:
    layout: str                            # "llada" | "dream"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    mask_token_id: int
    head_dim: int = 0                      # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.layout not in ("llada", "dream"):
            raise ValueError(f"diffusion layout must be 'llada' or 'dream', got {self.layout!r}")
        self.head_dim = self.head_dim or self.hidden_size // max(self.num_heads, 1)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "intermediate_size", "head_dim", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"diffusion model config {name} must be an integer > 0, "
                                 f"got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be a token id in [0, {self.vocab_size}), "
                             f"got {self.mask_token_id!r}")

    @property
    def logits_shift(self) -> int:
        """Dream's output at position i - 1 predicts token i; LLaDA's at i predicts i."""
        return 1 if self.layout == "dream" else 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DiffusionLMConfig":
        archs = d.get("architectures") or []
        layout = DIFFUSION_LAYOUTS.get(archs[0] if archs else "")
        if layout is None:
            raise ValueError(f"not a masked-diffusion architecture: {archs!r}; supported: "
                             f"{sorted(DIFFUSION_LAYOUTS)}")
        if d.get("mask_token_id") is None:
            raise ValueError("a masked-diffusion config needs mask_token_id")
        # options of the published configs this family does not implement: refused, not ignored
        defaults = ({"block_type": "llama", "alibi": False, "rope": True, "input_emb_norm": False,
                     "scale_logits": False, "clip_qkv": None} if layout == "llada"
                    else {"rope_scaling": None})
        unsupported = {k: d[k] for k, v in defaults.items() if k in d and d[k] != v}
        if unsupported:
            raise ValueError(f"unsupported {layout} config options {unsupported} (supported: "
                             f"{defaults})")
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if layout == "llada":
            heads = d.get("n_heads")
            return cls(layout, vocab_size=d.get("embedding_size") or d["vocab_size"],
                       hidden_size=d.get("d_model"), num_layers=d.get("n_layers"),
                       num_heads=heads, num_kv_heads=d.get("n_kv_heads") or heads,
                       intermediate_size=d.get("mlp_hidden_size"),
                       mask_token_id=d["mask_token_id"], rms_norm_eps=d.get("rms_norm_eps", 1e-5),
                       rope_theta=d.get("rope_theta", 10000.0),
                       max_position=d.get("max_sequence_length", 4096),
                       tie_word_embeddings=bool(d.get("weight_tying", False)),
                       qkv_bias=bool(d.get("include_qkv_bias") or d.get("include_bias")),
                       eos_token_ids=eos_ids)
        heads = d.get("num_attention_heads")
        return cls(layout, vocab_size=d["vocab_size"], hidden_size=d.get("hidden_size"),
                   num_layers=d.get("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=d.get("num_key_value_heads") or heads,
                   intermediate_size=d.get("intermediate_size"), mask_token_id=d["mask_token_id"],
                   head_dim=d.get("head_dim") or 0, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                   rope_theta=d.get("rope_theta", 10000.0),
                   max_position=d.get("max_position_embeddings", 4096),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), qkv_bias=True,
                   eos_token_ids=eos_ids)

    def to_llada_dict(self) -> dict[str, Any]:
        """config.json in LLaDA's vocabulary (what ``kvforge train-diffusion`` saves)."""
        return {"architectures": ["LLaDAModelLM"], "model_type": "llada",
                "vocab_size": self.vocab_size, "embedding_size": self.vocab_size,
                "d_model": self.hidden_size, "n_layers": self.num_layers,
                "n_heads": self.num_heads, "n_kv_heads": self.num_kv_heads,
                "mlp_hidden_size": self.intermediate_size, "mask_token_id": self.mask_token_id,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_sequence_length": self.max_position,
                "weight_tying": self.tie_word_embeddings, "include_qkv_bias": self.qkv_bias,
                "include_bias": False, "eos_token_id": self.eos_token_ids[0]
                if self.eos_token_ids else None}
