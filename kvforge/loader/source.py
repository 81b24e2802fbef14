"""ModelSource: one handle on a model's config, weights and tokenizer, whatever the file format.

    load_model_source(None)            -> the default GGUF (see default_model.py)
    load_model_source("dir/")          -> HF directory (config.json + safetensors)
    load_model_source("model.gguf")    -> GGUF file
    load_model_source("gemma-3-270m")  -> a catalogue model, pulled on first use (catalog.py)

Weights always come out under Hugging Face parameter names, one tensor at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal

import torch

from kvforge.loader import gguf_loader, hf_loader
from kvforge.loader.catalog import CATALOG, resolve_model
from kvforge.models.config import ModelConfig
from kvforge.tokenizer import Tokenizer

ModelFormat = Literal["gguf", "hf"]


@dataclass
class ModelSource:
    config: ModelConfig
    path: str
    format: ModelFormat
    # the open GGUF reader: parsing its metadata costs seconds, so reuse it for the weights
    _reader: Any = field(default=None, repr=False, compare=False)
    # the tokenizer, read once: the engine, a draft model's vocabulary check and calibration
    # each ask for it, and a 152k-262k-token vocabulary takes 0.3-0.7 s to read
    _tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.format not in ("gguf", "hf"):
            raise ValueError(f"model format must be 'gguf' or 'hf', got {self.format!r}")

    def gguf_reader(self) -> gguf_loader.GGUFFile:
        """The GGUF file's reader, opened once and kept (its tensors map the file)."""
        if self.format != "gguf":
            raise ValueError(f"{self.path!r} is a {self.format} model, not a GGUF file")
        if self._reader is None:
            self._reader = gguf_loader.open_gguf(self.path)
        return self._reader

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, tensor) pairs; float32, or the file's float16/bfloat16."""
        if self.format == "gguf":
            return self.select_weights(gguf_loader.iter_gguf_weights(self.gguf_reader()))
        return self.select_weights(hf_loader.iter_hf_weights(self.path))

    def select_weights(self, weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """What this source holds of the file's (name, weight) pairs, float tensors or GGUF
        blocks alike: all of them here; a tensor-parallel rank's slice of them in
        ``distributed.tp_model.ShardedModelSource``."""
        return weights

    def load_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (one object per source: later calls return the first)."""
        if self._tokenizer is None:
            self._tokenizer = (Tokenizer.from_gguf(self.path) if self.format == "gguf"
                               else Tokenizer.from_pretrained(self.path))
        return self._tokenizer


def load_model_source(path: str | None = None) -> ModelSource:
    given = path
    path = os.path.abspath(os.path.expanduser(resolve_model(path)))
    if os.path.isdir(path):
        if not hf_loader.is_hf_dir(path):
            raise FileNotFoundError(f"model directory {path!r} has no config.json")
        config = ModelConfig.from_hf_dict(hf_loader.read_hf_config(path))
        return ModelSource(config=config, path=path, format="hf")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"unrecognised model file {path!r}: expected a .gguf file or a HF "
                             f"model directory")
        reader = gguf_loader.open_gguf(path)
        config = ModelConfig.from_hf_dict(gguf_loader.gguf_to_hf_config(reader))
        return ModelSource(config=config, path=path, format="gguf", _reader=reader)
    raise FileNotFoundError(f"model path not found: {path!r} ({given!r} is not a catalogue "
                            f"name either: {', '.join(CATALOG)})")
