"""The lazy GGUF reader (kvforge/loader/gguf_file.py) against gguf.GGUFReader, the reference:
same keys, values, value types, tensors (names, types, shapes, offsets, bytes), and clear
errors for malformed files."""
from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from kvforge.loader.gguf_file import GGUFFile, GGUFFormatError


def _write_sample(path, alignment: int | None = None) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo")
    w.add_array("test.strings", ["a", "", "ccc", "日本"])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 8)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _assert_same_as_reference(path) -> None:
    ours, ref = GGUFFile(str(path)), gguf.GGUFReader(str(path), "r")
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]   # reader's pseudo-keys
    assert list(ours.fields) == ref_keys
    for key in ref_keys:
        assert ours.fields[key].contents() == ref.fields[key].contents(), key
        assert [int(t) for t in ours.fields[key].types] == [int(t) for t in ref.fields[key].types]
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.n_bytes, a.n_elements, a.data_offset) == (
            b.name, b.tensor_type, b.n_bytes, b.n_elements, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, np.asarray(b.data))
        assert type(a.data) is np.ndarray                 # a plain view, not an np.memmap


@pytest.mark.parametrize("alignment", [None, 64])
def test_matches_gguf_reader_on_a_written_file(tmp_path, alignment):
    path = tmp_path / "sample.gguf"
    _write_sample(path, alignment)
    _assert_same_as_reference(path)
    f = GGUFFile(str(path))
    assert f.fields["test.strings"].contents() == ["a", "", "ccc", "日本"]
    assert f.fields["test.str"].contents() == "héllo" and len(f.fields["test.strings"]) == 4
    assert f.data_offset % (alignment or 32) == 0


def test_matches_gguf_reader_on_the_default_model(default_model_path):
    _assert_same_as_reference(default_model_path)


def test_malformed_files_are_clear_errors(tmp_path):
    path = tmp_path / "sample.gguf"
    _write_sample(path)
    blob = path.read_bytes()
    cases = {
        "magic": b"GGUX" + blob[4:],
        "version": blob[:4] + struct.pack("<I", 99) + blob[8:],
        "short": blob[:10],
        "truncated header": blob[:60],
        "truncated data": blob[:-40],      # past the last tensor's padding
    }
    messages = {"magic": "magic", "version": "version 99", "short": "too short",
                "truncated header": "truncated", "truncated data": "truncated"}
    for name, data in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.gguf"
        bad.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=messages[name]):
            GGUFFile(str(bad))
