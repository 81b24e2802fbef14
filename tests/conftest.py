"""Shared fixtures: the default model, tiny random HF models, and the HF oracle."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# engines run the build's default kernel plans unless a test tunes (tests/kernels/
# test_linear_tune.py): no timing in the suite, no writes to ~/.cache/kvforge/tune
os.environ.setdefault("KVFORGE_TUNE", "0")
# the CLI tests run the engine in their own process; a user's keep-alive setting would send
# them to background engines instead (tests/server/test_keep_alive.py asks for those itself)
os.environ.pop("KVFORGE_KEEP_ALIVE", None)

import pytest
import torch

from tests.helpers import hf_oracle


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from kvforge.loader.default_model import default_model_path as find
    return find()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    """SmolLM2's tokenizer saved as an HF directory, shared by the tiny random models (or
    ``KVFORGE_TEST_TOKENIZER_DIR``, such a directory saved earlier: for machines that run the
    device tests without the default model's package)."""
    from transformers import AutoTokenizer
    saved = os.environ.get("KVFORGE_TEST_TOKENIZER_DIR")
    if saved:
        return saved
    from kvforge.loader.default_model import default_model_path as find
    default_model_path = find()
    d = tmp_path_factory.mktemp("smol_tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(default_model_path),
                                        gguf_file=os.path.basename(default_model_path))
    tok.save_pretrained(d)
    return str(d)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, tokenizer_dir):
    """make(kind, **config_overrides) -> (hf_dir, hf_model); cached per argument set."""
    cache: dict = {}

    def make(kind: str = "llama", **overrides):
        key = (kind, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{kind}")
            model = hf_oracle.build_tiny_model(kind, str(d), tokenizer_dir, **overrides)
            cache[key] = (str(d), model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def hf_smollm(default_model_path):
    return hf_oracle.load_hf_gguf(default_model_path)


@pytest.fixture(scope="session")
def smollm_llm(default_model_path):
    """The default model dequantized to fp32 (``quantization="none"``): the path that equals HF
    transformers to float rounding, which the equivalence tests hold it to. The default native
    path (8-bit activations) has tests of its own (tests/engine/test_hf_equivalence.py)."""
    from kvforge import LLM
    return LLM(default_model_path, kv_cache_memory="256MiB", max_model_len=2048,
               quantization="none")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    yield
