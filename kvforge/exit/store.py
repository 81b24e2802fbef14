"""Trained exit heads on disk, found by model file identity:

    $KVFORGE_CACHE_DIR/exit_heads/<model>-<hash>/heads.safetensors   adapter + norm per layer
                                               /heads.json          layers, sizes, training

(default cache dir ~/.cache/kvforge; the hash covers the file's path, size and modification
time, as for activation-sparsity thresholds). The heads are trained on the fp32 forward and
serve every quantization of the same file: they only read the residual stream.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvforge.exit.heads import ExitHeads

WEIGHTS_FILE = "heads.safetensors"
CONFIG_FILE = "heads.json"


def cache_root() -> Path:
    from kvforge.loader.catalog import cache_root as kvforge_cache_root
    return Path(kvforge_cache_root()) / "exit_heads"


def heads_dir(model_path: str) -> Path:
    from kvforge.sparsity.cache import model_key
    return cache_root() / model_key(model_path, None)


def save_heads(heads: ExitHeads, directory: Path, info: dict) -> Path:
    """Write weights then config, each atomically (a reader sees old or new, never half)."""
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"{name}": t.detach().contiguous().cpu() for name, t in heads.state_dict().items()}
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(directory / WEIGHTS_FILE)
    config = {"layers": heads.layers, "num_layers": heads.num_layers,
              "hidden_size": heads.hidden_size, "eps": next(iter(heads.heads.values())).eps,
              **info}
    tmp = directory / (CONFIG_FILE + ".tmp")
    tmp.write_text(json.dumps(config, indent=1))
    tmp.replace(directory / CONFIG_FILE)
    return directory


def load_heads(directory: Path) -> tuple[ExitHeads, dict]:
    """(heads, config) from ``directory``; FileNotFoundError when nothing was trained there."""
    from safetensors.torch import load_file
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(f"no exit heads in {str(directory)!r}; train them with "
                                f"`kvforge train-exit-heads`")
    config = json.loads(config_path.read_text())
    heads = ExitHeads(config["layers"], config["num_layers"], config["hidden_size"], config["eps"])
    heads.load_state_dict(load_file(str(weights_path)))
    heads.requires_grad_(False)
    return heads, config


def load_heads_for(model, model_path: str) -> ExitHeads:
    """The heads trained for this model file, checked against the model's shape. A family
    early exit does not run is refused first: no heads could be trained for it."""
    from kvforge.models.layerwise import layerwise_family
    layerwise_family(type(model), "early exit")
    heads, _ = load_heads(heads_dir(model_path))
    if heads.num_layers != model.num_layers or heads.hidden_size != model.config.hidden_size:
        raise ValueError(f"exit heads in {str(heads_dir(model_path))!r} were trained for "
                         f"{heads.num_layers} layers x {heads.hidden_size}, the model has "
                         f"{model.num_layers} x {model.config.hidden_size}; train them again")
    return heads
