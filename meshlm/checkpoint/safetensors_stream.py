"""safetensors files read and written one tensor at a time, so no file is ever held whole.

The format is simple enough to write by hand (https://github.com/huggingface/safetensors):

    8 bytes      N, the header's length, unsigned little-endian
    N bytes      a JSON header: {name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
                 "__metadata__": {str: str}}, padded with spaces to a multiple of 8 bytes
    the rest     the tensors' bytes, row-major and little-endian, back to back; the offsets count
                 from the end of the header and must tile the data without gaps

The library's own ``save_file`` takes a dict of every tensor, i.e. the whole model in memory.
Since the header only needs each tensor's shape and dtype, ``write_safetensors`` takes a *plan*
instead -- {name: ``PlannedTensor(shape, dtype, produce)``} -- writes the header from it, then calls
each ``produce()`` in turn, writes the bytes and lets the tensor go. A conversion that computes its
tensors one at a time (``meshlm convert``, ``meshlm upcycle``, ``meshlm checkpoint consolidate``)
therefore holds one output tensor (plus what producing it reads) at a time. The file is written
under a temporary name and renamed when complete.

Reading is the other half: ``SafetensorsReader`` parses one file's header and maps its data
read-only, so a tensor's shape and dtype are known without reading it, and ``read(name, box)``
copies exactly the rows asked for. ``SafetensorsFiles`` opens one file or the shards of a Hugging
Face index and hands out ``StoredTensor`` handles that can be narrowed (``handle[e]``,
``handle.split(sizes)``: how the fused expert tensors of a Hugging Face file are cut into
per-expert ones) and read with ``load()``, which reads only the handle's own rows.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from meshlm.errors import CheckpointError

DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
COPY_BLOCK = 8 << 20
"""Bytes of a file mapped at once while a tensor is copied out of it."""
BITS = {1: (torch.uint8, "u1"), 2: (torch.int16, "<i2"), 4: (torch.int32, "<i4"), 8: (torch.int64, "<i8")}
"""Element size -> (torch, numpy) integer dtypes of that size, through which a tensor's bytes are copied."""


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a file still to be written: its shape and dtype now, its values on demand."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def planned(value) -> PlannedTensor:
    """A PlannedTensor as it is, or one for a tensor already in memory."""
    if isinstance(value, PlannedTensor):
        return value
    return PlannedTensor(tuple(value.shape), value.dtype, lambda: value)


def nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def _header(plan: dict[str, PlannedTensor], metadata: dict | None) -> bytes:
    entries, offset = {}, 0
    if metadata:
        entries["__metadata__"] = {str(key): str(value) for key, value in metadata.items()}
    for name, tensor in plan.items():
        if tensor.dtype not in DTYPE_NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored in a safetensors file.")
        size = nbytes(tensor.shape, tensor.dtype)
        entries[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
    return struct.pack("<Q", len(text)) + text


def write_safetensors(path: str | os.PathLike, tensors: Mapping, metadata: dict | None = None) -> Path:
    """Write ``tensors`` ({name: PlannedTensor or tensor}) to ``path``, one tensor at a time, in order."""
    path = Path(path)
    plan = {name: planned(value) for name, value in tensors.items()}
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as stream:
            stream.write(_header(plan, metadata))
            for name, entry in plan.items():
                tensor = entry.produce()
                if tuple(tensor.shape) != tuple(entry.shape) or tensor.dtype != entry.dtype:
                    raise RuntimeError(f"{name}: produced {tensor.dtype} {tuple(tensor.shape)}, but the plan "
                                       f"said {entry.dtype} {tuple(entry.shape)}")
                _write_bytes(stream, tensor)
                del tensor  # one tensor at a time
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _write_bytes(stream, tensor: torch.Tensor) -> None:
    """The tensor's bytes, row-major, without an extra whole copy when it is already contiguous on CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel():
        stream.write(memoryview(flat.view(torch.uint8).numpy()))


class StoredTensor:
    """A tensor (or rows of one) in a safetensors file, read only when ``load()`` is called.

    It answers ``shape``, ``dtype``, ``[index]`` and ``split(sizes)`` like a tensor, so code written
    for tensors in memory (a Hugging Face adapter's checks and fused-expert splitting) runs on it
    unchanged; only the final ``load()`` reads, and only this handle's rows."""

    def __init__(self, files: SafetensorsFiles, path: Path, name: str, shape, dtype: torch.dtype,
                 index: tuple = (), narrowable: bool = True):
        self.files, self.path, self.name, self.dtype, self.index = files, path, name, dtype, index
        self.shape = torch.Size(shape)
        self.narrowable = narrowable
        """False for a piece split along a later dim, whose index no longer ends at its dim 0."""

    def _narrowed(self, index, shape) -> StoredTensor:
        """Narrow this handle's dim 0 by ``index`` (an int or a slice), kept as one index of the file's
        tensor: its dim 0 is the last slice of ``self.index`` if there is one, else the next dim."""
        if not self.narrowable:
            raise ValueError(f"{self.name}: a piece split along a later dim is read whole, not narrowed")
        if self.index and isinstance(self.index[-1], slice):
            outer = self.index[-1]
            inner = outer.start + index if isinstance(index, int) else slice(outer.start + index.start,
                                                                              outer.start + index.stop)
            combined = self.index[:-1] + (inner,)
        else:
            combined = self.index + (index,)
        return StoredTensor(self.files, self.path, self.name, shape, self.dtype, combined)

    def __getitem__(self, index: int) -> StoredTensor:
        """Row ``index`` of dim 0 (only whole rows are supported: one integer)."""
        if not isinstance(index, int) or not -self.shape[0] <= index < self.shape[0]:
            raise IndexError(f"{self.name}: index {index!r} out of range for shape {tuple(self.shape)}")
        return self._narrowed(index % self.shape[0], self.shape[1:])

    def split(self, sizes: list[int], dim: int = 0) -> list[StoredTensor]:
        """Consecutive pieces along ``dim`` of the given sizes (like ``torch.split``). Along a later
        dim only a handle of whole trailing dims splits (the file's tensor or rows picked by
        index), and its pieces are read whole, not narrowed again."""
        if not 0 <= dim < len(self.shape) or sum(sizes) != self.shape[dim] or (
                dim and not all(isinstance(entry, int) for entry in self.index)):
            raise ValueError(f"{self.name}: cannot split {tuple(self.shape)} into {sizes} along dim {dim}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        if dim == 0:
            return [self._narrowed(slice(start, start + size), (size, *self.shape[1:]))
                    for start, size in zip(starts, sizes)]
        return [StoredTensor(self.files, self.path, self.name, (*self.shape[:dim], size, *self.shape[dim + 1:]),
                             self.dtype, self.index + (slice(None),) * dim + (slice(start, start + size),),
                             narrowable=False)
                for start, size in zip(starts, sizes)]

    def load(self) -> torch.Tensor:
        """The values, read from the file by slice."""
        return self.files.read(self.path, self.name, self.index)

    def __repr__(self) -> str:
        return f"StoredTensor({self.path.name}:{self.name}{list(self.index) or ''}, {tuple(self.shape)}, {self.dtype})"


def load(value) -> torch.Tensor:
    """A tensor in memory as it is; a ``StoredTensor`` read from its file (and any other handle with a
    ``load()``, such as an HF adapter's tensor computed from stored ones, read when asked)."""
    return value if isinstance(value, torch.Tensor) else value.load()


class SafetensorsReader:
    """One safetensors file: its header parsed, its data mapped read-only and read box by box.

    Why not ``safe_open``: its PyTorch path maps the whole file *copy-on-write* (private and
    writable), which the kernel charges to the process's data size in full, as if the file had
    been loaded, even though only the rows read are ever touched. A read-only shared mapping
    costs address space only, and a read copies exactly the box asked for. After each read the
    mapped pages are dropped from the process (``MADV_DONTNEED``; they stay in the page cache),
    so its resident size counts the copies it holds, not the file it has read."""

    def __init__(self, path: str | os.PathLike):
        import numpy as np
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as stream:
                (length,) = struct.unpack("<Q", stream.read(8))
                if length > size - 8:
                    raise ValueError(f"header of {length} bytes in a file of {size}")
                header = json.loads(stream.read(length))
                self.metadata = header.pop("__metadata__", None) or {}
                self.entries = {name: (DTYPES[entry["dtype"]], tuple(entry["shape"]),
                                       tuple(entry["data_offsets"])) for name, entry in header.items()}
                end = max((offsets[1] for _, _, offsets in self.entries.values()), default=0)
                if 8 + length + end > size:
                    raise ValueError(f"the header describes {8 + length + end} bytes, the file holds {size}")
                self.mapping = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ) if end else None
            self.data = (np.frombuffer(self.mapping, dtype=np.uint8, count=end, offset=8 + length)
                         if end else np.zeros(0, dtype=np.uint8))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
            raise CheckpointError(f"{self.path}: unreadable or truncated safetensors file ({error}); "
                                  "write or download it again.") from error

    def read(self, name: str, box: tuple = (), out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name``, or the part of it that ``box`` (ints and slices, numpy-style) selects,
        copied into ``out`` when given (a CPU tensor of that shape, strided or not: no other copy)."""
        dtype, shape, (begin, end) = self.entries[name]
        bits = BITS[torch.empty((), dtype=dtype).element_size()]  # copied as integers: bf16 has no numpy type
        region = self.data[begin:end].view(bits[1]).reshape(shape)
        region = region[box] if box else region
        if out is None or out.device.type != "cpu" or out.dtype != dtype:
            staged = torch.empty(region.shape, dtype=dtype)  # the one copy, from torch's allocator
            self._copy(staged.view(bits[0]).numpy(), region)
            return staged if out is None else out.copy_(staged)
        self._copy(out.view(bits[0]).numpy(), region)
        return out

    def _copy(self, destination, region) -> None:
        """Copy in blocks of rows of about ``COPY_BLOCK`` bytes, unmapping each block's pages after
        it (``MADV_DONTNEED``; the page cache keeps them), so the process's resident size counts
        the copy it holds plus one block of the file, not the whole tensor twice."""
        import numpy as np
        if region.ndim == 0 or region.shape[0] == 0:
            np.copyto(destination, region)
            return
        rows = max(1, COPY_BLOCK // max(1, region[0].nbytes))
        for start in range(0, region.shape[0], rows):
            np.copyto(destination[start:start + rows], region[start:start + rows])
            if self.mapping is not None and hasattr(self.mapping, "madvise"):
                self.mapping.madvise(mmap.MADV_DONTNEED)


class SafetensorsFiles:
    """safetensors files opened for reading by slice; ``tensors`` holds a ``StoredTensor`` per name."""

    def __init__(self, paths):
        self.readers = {Path(path): SafetensorsReader(path) for path in paths}
        self.tensors = {name: StoredTensor(self, path, name, shape, dtype)
                        for path, reader in self.readers.items()
                        for name, (dtype, shape, _) in reader.entries.items()}

    def read(self, path: Path, name: str, index: tuple = ()) -> torch.Tensor:
        return self.readers[path].read(name, index)

    def close(self) -> None:
        self.readers = {}

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["DTYPES", "DTYPE_NAMES", "PlannedTensor", "SafetensorsFiles", "SafetensorsReader", "StoredTensor", "load", "nbytes",
           "planned", "write_safetensors"]
