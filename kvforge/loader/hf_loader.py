"""Read a Hugging Face model directory: config.json plus (possibly sharded) safetensors."""
from __future__ import annotations

import json
import os
from typing import Any, Iterator

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def read_hf_config(model_dir: str) -> dict[str, Any]:
    config_path = os.path.join(model_dir, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path!r} is not valid JSON: {e}") from e


def safetensors_files(model_dir: str) -> list[str]:
    """The weight files in load order: the single file, or each shard named by the index once."""
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    index_path = os.path.join(model_dir, SHARD_INDEX)
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
        files = [os.path.join(model_dir, s) for s in shards]
        for p in files:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"shard {p!r} listed in {index_path!r} is missing")
        return files
    raise FileNotFoundError(f"no {SINGLE_FILE} or {SHARD_INDEX} in {model_dir!r}")


def iter_hf_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) lazily, one tensor in memory at a time, in the file's dtype."""
    for path in safetensors_files(model_dir):
        try:
            handle = safe_open(path, framework="pt", device="cpu")
        except Exception as e:
            raise ValueError(f"{path!r} is not a valid safetensors file: {e}") from e
        with handle as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
