"""The engine a model runs on: ``LLMEngine`` (autoregressive, the paged KV cache and its
scheduler) or, for a masked-diffusion model, ``DiffusionEngine`` (kvforge/diffusion/engine.py:
the same request interface, whole-canvas generation). ``LLM``, the CLI and the server all
start their engine here."""
from __future__ import annotations

import os

from kvforge.config import EngineConfig


def is_diffusion_model(model: str | None) -> bool:
    """Whether ``model`` names an HF directory of a masked-diffusion architecture (checked from
    config.json alone: no weights read, GGUF files never are)."""
    from kvforge.loader import hf_loader
    from kvforge.loader.catalog import CATALOG, resolve_model
    from kvforge.models.diffusion_config import is_diffusion_architecture
    if model is None or model in CATALOG:
        return False
    path = os.path.abspath(os.path.expanduser(resolve_model(model)))
    if not hf_loader.is_hf_dir(path):
        return False
    archs = hf_loader.read_hf_config(path).get("architectures") or [""]
    return is_diffusion_architecture(archs[0])


def create_engine(config: EngineConfig):
    """LLMEngine, or DiffusionEngine for a masked-diffusion model."""
    if is_diffusion_model(config.model):
        from kvforge.diffusion.engine import DiffusionEngine
        return DiffusionEngine(config)
    from kvforge.engine.llm_engine import LLMEngine
    return LLMEngine(config)
