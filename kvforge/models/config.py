"""Model hyper-parameters in Hugging Face vocabulary, from config.json or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str                      # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int = 0
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    hf_config: dict[str, Any] = field(default_factory=dict)   # the raw dict, for family extras

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        archs = d.get("architectures") or []
        arch = archs[0] if archs else d.get("model_type", "unknown")
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        # LLaDA's config speaks OLMo: d_model, n_heads, n_layers, mlp_hidden_size
        n_heads = d.get("num_attention_heads") or d.get("n_head") or d.get("n_heads")
        rope_theta = d.get("rope_theta")
        rope_scaling = d.get("rope_scaling")
        rope_params = d.get("rope_parameters")  # transformers >= 5 keeps theta + scaling here
        if isinstance(rope_params, dict):
            rope_theta = rope_theta or rope_params.get("rope_theta")
            if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d.get("hidden_size") or d.get("n_embd") or d.get("d_model"),
            num_hidden_layers=d.get("num_hidden_layers") or d.get("n_layer") or d.get("n_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or d.get("n_kv_heads") or n_heads,
            intermediate_size=(d.get("intermediate_size") or d.get("n_inner")
                               or d.get("mlp_hidden_size") or 0),
            head_dim=d.get("head_dim"),
            rms_norm_eps=d.get("rms_norm_eps", d.get("layer_norm_epsilon", 1e-6)),
            rope_theta=rope_theta or 10000.0,
            rope_scaling=rope_scaling,
            max_position_embeddings=(d.get("max_position_embeddings") or d.get("n_positions")
                                     or d.get("max_sequence_length") or 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases (its config may say attention_bias=None)
            attention_bias=bool(d.get("attention_bias")) or d.get("model_type") == "qwen2",
            mlp_bias=d.get("mlp_bias", False),
            sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hf_config=dict(d),
        )
