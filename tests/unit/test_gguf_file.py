"""The fast GGUF header reader (agentspec.backends.embedded.gguf_file) reads what the gguf
package's own reader reads: every field, every tensor's type, shape and bytes; a bad file is
refused with a message saying what is wrong."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from agentspec.backends.embedded.gguf_file import GGUFFile  # noqa: E402

from helpers.families import random_quantized  # noqa: E402


def _write(path, rng):
    from gguf.quants import quantize

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(2)
    w.add_uint32("test.u32", 7)
    w.add_int64("test.i64", -5)
    w.add_float32("test.f32", 0.25)
    w.add_bool("test.flag", True)
    w.add_string("test.text", "héllo ✓")
    w.add_token_list(["a", "bé", "<|im_end|>", ""] * 50)
    w.add_token_types([1, 1, 3, 1] * 50)
    w.add_array("test.floats", [1.5, -2.0])
    w.add_tensor("norm.weight", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("half.weight", rng.standard_normal((8, 64)).astype(np.float16))
    q8 = quantize(rng.standard_normal((16, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8.weight", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    k4 = random_quantized(4, 512, "Q4_K", rng)
    w.add_tensor("k4.weight", k4, raw_shape=k4.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_reads_what_the_gguf_package_reads(tmp_path):
    path = _write(tmp_path / "t.gguf", np.random.default_rng(0))
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):   # the reader's own pseudo-fields (version, counts)
            continue
        assert ours.fields[key] == field.contents(), key
    assert ours.fields["test.text"] == "héllo ✓" and ours.fields["test.flag"] is True
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(x) for x in b.shape), a.name
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name


def test_bad_files_are_refused_saying_why(tmp_path):
    path = _write(tmp_path / "t.gguf", np.random.default_rng(1))
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:200])
    with pytest.raises(ValueError, match="header is cut short"):
        GGUFFile(tmp_path / "short.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "magic.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "magic.gguf")
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="GGUF version 9"):
        GGUFFile(tmp_path / "v9.gguf")
