"""Architecture name -> model class, imported lazily so a family's module loads only when used.

Keys are HF ``architectures`` names and GGUF ``general.architecture`` names. A new family adds
one line here pointing at its own module, e.g. ``"GPT2LMHeadModel": ("kvforge.models.gpt2",
"GPT2LMHeadModel")``.
"""
from __future__ import annotations

import importlib

from torch import nn

_MODELS: dict[str, tuple[str, str]] = {
    # HF architecture names
    "LlamaForCausalLM": ("kvforge.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("kvforge.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("kvforge.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("kvforge.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("kvforge.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "GPT2LMHeadModel": ("kvforge.models.gpt2", "GPT2LMHeadModel"),
    "GPTBigCodeForCausalLM": ("kvforge.models.gpt_bigcode", "GPTBigCodeForCausalLM"),
    "DeepseekV2ForCausalLM": ("kvforge.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "Gemma3ForCausalLM": ("kvforge.models.gemma3", "Gemma3ForCausalLM"),
    # GGUF general.architecture names
    "llama": ("kvforge.models.llama", "LlamaForCausalLM"),
    "mistral": ("kvforge.models.llama", "LlamaForCausalLM"),
    "qwen2": ("kvforge.models.llama", "LlamaForCausalLM"),
    "gemma3": ("kvforge.models.gemma3", "Gemma3ForCausalLM"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    """Add (or override) an architecture without editing this file, e.g. from a plugin or test."""
    _MODELS[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    module_name, class_name = _MODELS[architecture]
    return getattr(importlib.import_module(module_name), class_name)
