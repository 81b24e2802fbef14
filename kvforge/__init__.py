"""kvforge: a high-throughput, memory-efficient LLM inference and serving engine."""
from kvforge.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing kvforge does not load torch-heavy modules
    if name in ("LLM", "LLMEngine", "EngineConfig"):
        from kvforge.torch_import import import_torch_frozen
        import_torch_frozen()
    if name == "LLM":
        from kvforge.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from kvforge.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from kvforge.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
