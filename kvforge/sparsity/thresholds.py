"""Per-layer thresholds of one model at one target: what calibration makes and the cache keeps."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from kvforge.sparsity.config import KINDS, validate_sparsity


@dataclass
class SparsityThresholds:
    mode: str
    sparsity: float
    # kind -> one threshold per layer (kinds of the mode: config.KINDS)
    layers: dict[str, list[float]]
    # how they were made: corpus, token offset and count, model key
    calibration: dict = field(default_factory=dict)
    # kind -> one orthogonal Q [d, d] per layer: that input is thresholded as x Q (rotation.py);
    # kinds absent are thresholded as they are. Kept in a safetensors file beside the JSON.
    rotations: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_sparsity(self.sparsity, self.mode)
        if set(self.layers) != set(KINDS[self.mode]):
            raise ValueError(f"{self.mode} thresholds need kinds {KINDS[self.mode]}, "
                             f"got {sorted(self.layers)}")
        lengths = {len(v) for v in self.layers.values()}
        if len(lengths) != 1:
            raise ValueError(f"every kind needs one threshold per layer, got lengths {lengths}")
        if any(t < 0 for v in self.layers.values() for t in v):
            raise ValueError("thresholds must be >= 0")
        for kind, qs in self.rotations.items():
            if kind not in self.layers or len(qs) != self.num_layers:
                raise ValueError(f"rotations must be one per layer of a thresholded kind, got "
                                 f"{kind!r} with {len(qs)}")

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.layers.values())))

    def threshold(self, kind: str, layer: int) -> float:
        return self.layers[kind][layer]

    def rotation(self, kind: str, layer: int) -> torch.Tensor | None:
        qs = self.rotations.get(kind)
        return None if qs is None else qs[layer]

    def to_json(self) -> str:
        """Everything but the rotations (their own file: cache.py)."""
        return json.dumps({"mode": self.mode, "sparsity": self.sparsity, "layers": self.layers,
                           "calibration": self.calibration}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "SparsityThresholds":
        d = json.loads(text)
        return cls(d["mode"], float(d["sparsity"]),
                   {k: [float(t) for t in v] for k, v in d["layers"].items()},
                   d.get("calibration", {}))
