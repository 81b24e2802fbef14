"""Model loading: GGUF files and HF directories, seen through one ModelSource."""
from kvforge.loader.default_model import default_model_path
from kvforge.loader.source import ModelSource, load_model_source

__all__ = ["ModelSource", "load_model_source", "default_model_path"]
