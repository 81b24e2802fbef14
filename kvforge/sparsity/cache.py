"""Calibrated thresholds kept on disk, per model (file identity and quantization), mode,
allocation, rotation and S: ``$KVFORGE_CACHE_DIR/sparsity/<model>-<hash>/<mode>-<allocation>
[-pca]-S<0.500>.json`` (default cache dir ~/.cache/kvforge); the PCA rotations, which do not
depend on S, once per model in ``rotations-pca.safetensors`` beside them. Activations depend
on the weights, so a quantized model calibrates its own.
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


def cache_path(key: str, mode: str, sparsity: float, allocation: str = "uniform",
               rotation: str = "none") -> Path:
    if mode != "teal":
        allocation = "uniform"                # CATS has one kind: nothing to allocate
    rotated = "" if rotation == "none" else f"-{rotation}"
    return cache_root() / key / f"{mode}-{allocation}{rotated}-S{sparsity:.3f}.json"


def rotations_path(key: str, rotation: str = "pca") -> Path:
    return cache_root() / key / f"rotations-{rotation}.safetensors"


def load_thresholds(key: str, mode: str, sparsity: float, allocation: str = "uniform",
                    rotation: str = "none", num_layers: int | None = None
                    ) -> SparsityThresholds | None:
    from kvforge.sparsity.rotation import ROTATED_COORDINATES, load_rotations
    path = cache_path(key, mode, sparsity, allocation, rotation)
    if not path.is_file():
        return None
    try:
        thresholds = SparsityThresholds.from_json(path.read_text())
    except (ValueError, KeyError) as exc:     # a damaged file: calibrate again
        logger.warning("ignoring cached sparsity thresholds %s (%s)", path, exc)
        return None
    if num_layers is not None and thresholds.num_layers != num_layers:
        return None
    from kvforge.sparsity.calibrate import CALIBRATION_VERSION
    if thresholds.calibration.get("version", 1) != CALIBRATION_VERSION:
        return None                           # made by an older calibration: redo
    if rotation != "none":                    # thresholds of rotated inputs need their axes
        rotations = load_rotations(rotations_path(key, rotation), thresholds.num_layers)
        if rotations is None:
            return None
        rotated = thresholds.calibration.get("rotated", [])    # those whose rotation pays
        if rotated and thresholds.calibration.get("coordinates") != ROTATED_COORDINATES:
            return None                       # thresholds of coordinates computed otherwise
        thresholds.rotations = {kind: qs for kind, qs in rotations.items() if kind in rotated}
    return thresholds


def save_thresholds(key: str, thresholds: SparsityThresholds,
                    rotations: dict | None = None) -> Path:
    """The thresholds' JSON; ``rotations``: newly fitted axes of every rotated kind (those the
    thresholds use are named in their calibration's "rotated"), kept once per model."""
    from kvforge.sparsity.rotation import save_rotations
    rotation = thresholds.calibration.get("rotation", "none")
    path = cache_path(key, thresholds.mode, thresholds.sparsity,
                      thresholds.calibration.get("allocation", "uniform"), rotation)
    if rotations is not None:
        save_rotations(rotations_path(key, rotation), rotations)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(thresholds.to_json())
    tmp.replace(path)             # atomic: a concurrent reader never sees half a file
    return path


def load_or_calibrate(model, source, sparsity: float, mode: str, quantization: str | None,
                      allocation: str = "greedy", recalibrate: bool = False,
                      tokens: int | None = None, rotation: str = "none") -> SparsityThresholds:
    """The cached thresholds of this model, mode, allocation, rotation and S, else calibrated
    now (on ``tokens`` tokens, default calibrate.CALIBRATION_TOKENS) and cached. A model's
    cached PCA rotations serve every S (unless ``recalibrate``)."""
    from kvforge.sparsity.calibrate import CALIBRATION_TOKENS, calibrate, calibration_tokens
    from kvforge.sparsity.rotation import load_rotations
    if quantization in (None, "", "auto"):       # the method "auto" picks for this file
        from kvforge.quant.loading import auto_quantization
        quantization = auto_quantization(source)
    key = model_key(source.path, quantization)
    if not recalibrate:
        cached = load_thresholds(key, mode, sparsity, allocation, rotation, model.num_layers)
        if cached is not None:
            return cached
    # a warning, not info: a first start runs minutes of prefills (Qwen2.5-Coder-0.5B int8,
    # greedy: 4 min 19 s), which the user should know are not a hang
    logger.warning("calibrating %s (%s, rotation %s) activation sparsity %.2f for %s (once; "
                   "the thresholds are cached)", mode, allocation, rotation, sparsity, key)
    tokenizer = source.load_tokenizer()
    ids = calibration_tokens(tokenizer)[:tokens or CALIBRATION_TOKENS]
    rotations = fresh = None
    if rotation != "none":
        rotations = (None if recalibrate
                     else load_rotations(rotations_path(key, rotation), model.num_layers))
        if rotations is None:
            from kvforge.sparsity.rotation import ROTATION_TOKENS, calibrate_rotations
            rotations = fresh = calibrate_rotations(
                model, calibration_tokens(tokenizer, count=tokens or ROTATION_TOKENS))
    thresholds = calibrate(model, ids, sparsity, mode, allocation,
                           info={"model": key, "corpus": "shakespeare"}, rotation=rotation,
                           rotations=rotations)
    path = save_thresholds(key, thresholds, fresh)
    logger.info("sparsity thresholds cached at %s", path)
    return thresholds
