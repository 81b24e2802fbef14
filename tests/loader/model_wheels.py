"""Wheels that carry slices of a model file, as the catalogue's PyPI packages do, built locally."""
from __future__ import annotations

import hashlib
import os
import zipfile

from wheel.wheelfile import WheelFile

from kvforge.loader.catalog import CatalogEntry, CatalogPart


def write_data_wheel(folder: str, dist: str, version: str, files: dict[str, bytes]) -> str:
    """A pure-Python wheel of ``dist``==``version`` holding ``files`` (path in wheel -> bytes)."""
    stem = dist.replace("-", "_")
    path = os.path.join(folder, f"{stem}-{version}-py3-none-any.whl")
    info = f"{stem}-{version}.dist-info"
    with WheelFile(path, "w", compression=zipfile.ZIP_STORED) as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{info}/METADATA",
                     f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: kvforge-tests\n"
                                      "Root-Is-Purelib: true\nTag: py3-none-any\n")
    return path


def split_model(data: bytes, name: str, package: str, version: str, folder: str,
                cuts: list[int], *, filename: str | None = None) -> CatalogEntry:
    """Wheels ``<package>-part<i>`` in ``folder`` with ``data`` cut at ``cuts``, and the entry.

    Slice i lives at ``<module>/data/part<ii>.bin``, the layout of the real multi-part packages.
    """
    bounds = [0, *cuts, len(data)]
    parts = []
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]), start=1):
        dist = f"{package}-part{i}"
        file = f"{dist.replace('-', '_')}/data/part{i:02d}.bin"
        write_data_wheel(folder, dist, version, {
            f"{dist.replace('-', '_')}/__init__.py": b"", file: data[lo:hi]})
        parts.append(CatalogPart(dist, version, file, hi - lo,
                                 hashlib.sha256(data[lo:hi]).hexdigest()))
    return CatalogEntry(name=name, description=f"{name} (test)", quantization="F32",
                        filename=filename or f"{name}.gguf", size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), parts=tuple(parts))
