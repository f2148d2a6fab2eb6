"""A GGUF file's header, parsed in a fraction of a second, and its tensors as views of one memory map.

The ``gguf`` package's ``GGUFReader`` builds a numpy memmap view per metadata string: for a
Qwen2.5 file (151,936 tokens and as many merges) that is about 12 s of start-up before any weight
is read. This reader parses the header from bytes (``struct``; numeric arrays with ``numpy``) and
keeps the ``gguf`` package for what it is the reference of: the type constants, block sizes and
the dequantizers. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["GGUFFile", "GGUFTensor"]

_MAGIC = b"GGUF"
# value types: UINT8 INT8 UINT16 INT16 UINT32 INT32 FLOAT32 BOOL STRING ARRAY UINT64 INT64 FLOAT64
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]     # innermost first, as GGUF lists them (``gguf.GGUFReader``'s order)
    tensor_type: object        # gguf.GGMLQuantizationType
    data: np.ndarray           # rows [outer..., bytes of the innermost row] uint8 (quantized) or typed values


class GGUFFile:
    """``fields`` (key -> value: scalars, strings, lists) and ``tensors`` of a GGUF file; raises
    ValueError naming what is wrong with a file that is not GGUF v2/v3 or is cut short."""

    def __init__(self, path: str | Path):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = str(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mm
        if len(buf) < 24 or buf[:4] != _MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} (supported: 2, 3)")
        self._buf, self._off = buf, 24
        try:
            self.fields: dict[str, object] = {}
            for _ in range(n_kv):
                key = self._str()
                (vtype,) = self._unpack("<I")
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._str()
                (n_dims,) = self._unpack("<I")
                dims = self._unpack(f"<{n_dims}Q")
                ttype, offset = self._unpack("<IQ")
                infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        except struct.error:
            raise ValueError(f"{self.path}: the GGUF header is cut short") from None
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self._off // align) * align
        data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, dims, ttype, offset in infos:
            try:
                qt = GGMLQuantizationType(ttype)
            except ValueError:
                raise ValueError(f"{self.path}: tensor {name!r} has unknown GGML type {ttype}") from None
            block, size = GGML_QUANT_SIZES[qt]
            n = int(np.prod(dims)) if dims else 1
            if dims[0] % block:
                raise ValueError(f"{self.path}: tensor {name!r}: rows of {dims[0]} are not whole {qt.name} blocks")
            nbytes = n // block * size
            lo = start + offset
            if lo + nbytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
            raw = data[lo:lo + nbytes]
            outer = tuple(reversed(dims[1:]))
            if qt.name in ("F32", "F16", "F64", "I8", "I16", "I32", "I64"):
                arr = raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                                "I16": np.int16, "I32": np.int32, "I64": np.int64}[qt.name]).reshape(outer + (dims[0],))
            else:
                arr = raw.reshape(outer + (dims[0] // block * size,))
            self.tensors.append(GGUFTensor(name, dims, qt, arr))

    def release(self, arr: np.ndarray) -> None:
        """Drop the pages of ``arr`` (a tensor's view of the map) from this process's memory: a
        tensor repacked into its own copy need not stay resident twice (read again from the file
        if it is touched again)."""
        base = np.frombuffer(self._mm, dtype=np.uint8).__array_interface__["data"][0]
        start = arr.__array_interface__["data"][0] - base
        if not 0 <= start < len(self._mm):
            return
        page = mmap.PAGESIZE
        lo, hi = start // page * page, min(len(self._mm), start + arr.nbytes)
        if hi > lo and hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def _unpack(self, fmt: str):
        vals = struct.unpack_from(fmt, self._buf, self._off)
        self._off += struct.calcsize(fmt)
        return vals

    def _str(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buf, self._off)
        s = self._buf[self._off + 8:self._off + 8 + n]
        if len(s) != n:
            raise struct.error("string past the end")
        self._off += 8 + n
        return s.decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._str()
        if vtype in _SCALAR:
            return self._unpack(_SCALAR[vtype])[0]
        if vtype == _ARRAY:
            etype, n = self._unpack("<IQ")
            if etype in _NP:
                width = np.dtype(_NP[etype]).itemsize
                arr = np.frombuffer(self._buf, dtype=_NP[etype], count=n, offset=self._off)
                self._off += width * n
                return arr.tolist()
            if etype == _STRING:
                buf, off, out = self._buf, self._off, []
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(n):
                    (k,) = unpack(buf, off)
                    out.append(buf[off + 8:off + 8 + k].decode("utf-8", errors="replace"))
                    off += 8 + k
                self._off = off
                return out
            return [self._value(etype) for _ in range(n)]
        raise struct.error(f"unknown GGUF value type {vtype}")
