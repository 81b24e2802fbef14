"""Calibrated thresholds kept on disk, per model (file identity and quantization), mode and S:
``$KVFORGE_CACHE_DIR/sparsity/<model>-<hash>/<mode>-S<0.500>.json`` (default cache dir
~/.cache/kvforge). Activations depend on the weights, so a quantized model calibrates its own.
"""
from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from kvforge.sparsity.thresholds import SparsityThresholds

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    from kvforge.loader.catalog import cache_root as kvforge_cache_root
    return Path(kvforge_cache_root()) / "sparsity"


def model_key(path: str, quantization: str | None) -> str:
    """The model file or directory by absolute path, size and modification time, plus the
    quantization its activations come from."""
    p = Path(path).resolve()
    st = p.stat()
    digest = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|{quantization or 'none'}"
                            .encode()).hexdigest()[:12]
    return f"{p.stem or p.name}-{digest}"


def cache_path(key: str, mode: str, sparsity: float, allocation: str = "uniform") -> Path:
    if mode != "teal":
        allocation = "uniform"                # CATS has one kind: nothing to allocate
    return cache_root() / key / f"{mode}-{allocation}-S{sparsity:.3f}.json"


def load_thresholds(key: str, mode: str, sparsity: float,
                    allocation: str = "uniform") -> SparsityThresholds | None:
    path = cache_path(key, mode, sparsity, allocation)
    if not path.is_file():
        return None
    try:
        return SparsityThresholds.from_json(path.read_text())
    except (ValueError, KeyError) as exc:     # a damaged file: calibrate again
        logger.warning("ignoring cached sparsity thresholds %s (%s)", path, exc)
        return None


def save_thresholds(key: str, thresholds: SparsityThresholds) -> Path:
    path = cache_path(key, thresholds.mode, thresholds.sparsity,
                      thresholds.calibration.get("allocation", "uniform"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(thresholds.to_json())
    tmp.replace(path)             # atomic: a concurrent reader never sees half a file
    return path


def load_or_calibrate(model, source, sparsity: float, mode: str, quantization: str | None,
                      allocation: str = "greedy", recalibrate: bool = False,
                      tokens: int | None = None) -> SparsityThresholds:
    """The cached thresholds of this model, mode and S, else calibrated now (on ``tokens``
    tokens, default calibrate.CALIBRATION_TOKENS) and cached."""
    from kvforge.sparsity.calibrate import CALIBRATION_TOKENS, calibrate, calibration_tokens
    if quantization in (None, "", "auto"):       # the method "auto" picks for this file
        from kvforge.quant.loading import auto_quantization
        quantization = auto_quantization(source)
    key = model_key(source.path, quantization)
    if not recalibrate:
        cached = load_thresholds(key, mode, sparsity, allocation)
        if cached is not None and cached.num_layers == model.num_layers:
            return cached
    logger.info("calibrating %s (%s) activation sparsity %.2f for %s", mode, allocation,
                sparsity, key)
    ids = calibration_tokens(source.load_tokenizer())[:tokens or CALIBRATION_TOKENS]
    thresholds = calibrate(model, ids, sparsity, mode, allocation,
                           info={"model": key, "corpus": "shakespeare"})
    path = save_thresholds(key, thresholds)
    logger.info("sparsity thresholds cached at %s", path)
    return thresholds
