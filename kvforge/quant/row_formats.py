"""Saved-row formats that live next to their methods (fp4, zeroquant, spqr), so that
serialize.py reads them without knowing each one.

A format registers the suffix of its marker tensor (e.g. ``fp4codes``: ``<name>.fp4codes``
starts a row set) with a reader that builds the rows from the marker's stem, and the suffixes of
its companion tensors (read by the reader, skipped by the directory walk). Its rows object writes
the same names back with ``saved_tensors(name, rows: slice)``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Reader = Callable[[Callable[[str], torch.Tensor], str], Any]
_READERS: dict[str, Reader] = {}
_COMPANIONS: set[str] = set()


class GroupedCodeRows:
    """What rows of group-wise codes (``codes`` [n, Kp] with one ``scale`` [n, Kp/G] per group of
    columns, logical width ``in_features``) derive from their fields: the logical shape the
    model's loader checks like a tensor's, and the group size. Mixed into the rows dataclasses
    (int4.Int4Blocks, fp4.FP4Rows)."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.shape[0], self.in_features)

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]


def register_row_format(marker: str, companions: tuple[str, ...], reader: Reader) -> None:
    if marker in _READERS or marker in _COMPANIONS:
        raise ValueError(f"saved-row suffix {marker!r} is registered twice")
    _READERS[marker] = reader
    _COMPANIONS.update(companions)


def _ensure_loaded() -> None:
    from kvforge.quant.base import available_quantizations
    available_quantizations()          # imports every method module, hence every format


def registered_companions() -> set[str]:
    _ensure_loaded()
    return set(_COMPANIONS)


def read_registered_rows(suffix: str, get_tensor: Callable[[str], torch.Tensor], stem: str):
    """The rows whose marker tensor is ``<stem>.<suffix>``, or None if ``suffix`` is not a
    registered marker."""
    _ensure_loaded()
    reader = _READERS.get(suffix)
    return None if reader is None else reader(get_tensor, stem)
