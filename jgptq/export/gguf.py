"""GGUF files from numpy arrays: float tensors and GGML block payloads (numpy and the ``gguf`` package only).

A GGUF file is an architecture name, typed metadata and an ordered list of tensors. :func:`write_gguf` takes
exactly that and writes it atomically (a temporary file in the same folder, renamed once complete).

Tensors are :class:`GGUFTensor` entries:

- float data (any float dtype) written as ``"f32"``, ``"f16"`` or ``"bf16"``; numpy order (outer ... inner) is
  written reversed as ggml ``ne``, so an (out, in) matrix becomes ne = {in, out};
- GGML blocks: a uint8 payload (..., rows, cols // block_size, type_size), the layout of
  :class:`jgptq.export.GGMLWeight`, written with its GGML type (``"q4_k"``, ``"iq2_xxs"``, ...). A stack of
  experts (n_expert, rows, blocks, type_size) becomes ne = {cols, rows, n_expert}.

The data may be a loader (a function returning the array) with the tensor's shape declared: the header is written
from the declared shapes and each loader is called when its tensor's bytes are written, so a model larger than
memory in float32 is written one tensor at a time.

Example::

    from jgptq.export.gguf import GGUFTensor, write_gguf

    write_gguf("tiny.gguf", "llama", {"llama.block_count": 2, ...},
               [GGUFTensor("token_embd.weight", embed, "f16"),
                GGUFTensor("blk.0.attn_q.weight", record.payload, record.format), ...])
"""

from __future__ import annotations

from jgptq.surface import option
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Mapping

import gguf
import numpy as np

from jgptq.export.gguf_tensor import (FLOAT_TYPES, GGUFTensor, file_bytes,  # noqa: F401  (public here too)
                                     ggml_type, typed_metadata)


def write_gguf(path, arch: str, metadata: Mapping[str, Any], tensors: Iterable[GGUFTensor], *,
               overwrite: bool = False, alignment: int | None = None, verify: bool = True) -> Path:
    """Writes a GGUF v3 file, atomically (a :class:`GGUFStream` given every tensor at once).

    Args:
      path: the file to write.
      arch: ``general.architecture`` (``"llama"``, ``"qwen3moe"``, ...).
      metadata: key -> value, in the order to write. A value is a bool, an int >= 0 (UINT32), a float (FLOAT32),
        a str, a list of str / int (INT32) / float (FLOAT32), or a ``(value, gguf.GGUFValueType)`` pair for any
        other type (``(value, GGUFValueType.ARRAY, sub_type)`` for arrays). ``general.architecture`` is written
        from ``arch``.
      tensors: :class:`GGUFTensor` entries in file order (names unique).
      overwrite: replace an existing file.
      alignment: ``general.alignment`` (default 32).
      verify: read every tensor back from the file once written and compare its bytes, and parse the finished
        file with the ``gguf`` package's reader, checking each tensor's name, type, shape and place, before the
        file takes ``path``'s place (a short or corrupt write raises; nothing is put in place).
    Returns:
      The path written.
    Raises:
      FileExistsError: ``path`` exists and ``overwrite`` is False. ValueError: a bad tensor or metadata value,
      a duplicate tensor name, or ``general.architecture`` in ``metadata`` that differs from ``arch``.
      OSError: the file read back does not hold the tensors given (``verify``).
    """
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, GGUFTensor):
            raise ValueError(f"write_gguf: tensors must be GGUFTensor entries, got {type(t).__name__}")
    with GGUFStream(path, arch, metadata, [(t.name, t.shape) for t in tensors], overwrite=overwrite,
                    alignment=alignment, verify=verify) as stream:
        for t in tensors:
            stream.write(t)
        return stream.finish()


class GGUFStream:
    """A GGUF v3 file written one tensor at a time, in a declared order, as the tensors become available; the
    header goes in last.

    Every field of a GGUF header has a size fixed by the tensor names, their number of dimensions and the
    metadata values, not by the tensors' types or sizes: the data can start at its final place before any type
    is known, and :meth:`finish` writes the header (types, offsets, and metadata that may change in value but
    not in encoded size, such as ``general.file_type``) in front of it. The file is a temporary one beside
    ``path`` until :meth:`finish` renames it; :meth:`abort` (or leaving a ``with`` block by an exception) removes
    it.

    Example::

        with GGUFStream("m.gguf", "llama", meta, [("blk.0.attn_q.weight", (4096, 4096)), ...]) as s:
            for t in tensors_as_they_come():       # GGUFTensor entries in the declared order
                s.write(t)
            s.finish({**meta, "general.file_type": 15})
    """

    def __init__(self, path, arch: str, metadata: Mapping[str, Any], layout: Iterable[tuple], *,
                 overwrite: bool = False, alignment: int | None = None, verify: bool = True):
        self.path = Path(os.fspath(path))
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass {option('overwrite')} to replace it")
        if self.path.exists() and self.path.is_dir():
            raise IsADirectoryError(f"{self.path} is a folder, not a GGUF file path")
        self.arch, self.verify = arch, verify
        self.alignment = 32 if alignment is None else int(alignment)
        self.layout = [(str(name), tuple(int(n) for n in shape)) for name, shape in layout]
        names = [name for name, _ in self.layout]
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"write_gguf: tensor name {twice!r} appears twice")
        self._written: list = []          # (type name, nbytes) per tensor written
        self._offset = 0                  # next tensor's offset in the data section
        self._metadata = dict(metadata)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header = self._header(self._metadata, [("f32", 0)] * len(self.layout))   # types do not change its size
        self._header_size = len(header)
        self._data_start = _pad(len(header), self.alignment)
        fd, self._tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._fd = fd

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if kind is not None:
            self.abort()
        return False

    @property
    def next_name(self) -> str | None:
        """The name of the tensor :meth:`write` takes next (None when all are written)."""
        return self.layout[len(self._written)][0] if len(self._written) < len(self.layout) else None

    def write(self, t: GGUFTensor) -> None:
        """Writes the next tensor of the layout (its loader is called now) at its final place; with ``verify``
        its bytes are read back from the file and compared."""
        if self._fd is None:
            raise ValueError(f"{self.path}: the GGUF stream is closed")
        if not isinstance(t, GGUFTensor):
            raise ValueError(f"write_gguf: tensors must be GGUFTensor entries, got {type(t).__name__}")
        i = len(self._written)
        if i >= len(self.layout):
            raise ValueError(f"{self.path}: {t.name} is one tensor more than the {len(self.layout)} declared")
        name, shape = self.layout[i]
        if (t.name, t.shape) != (name, shape):
            raise ValueError(f"{self.path}: tensor {i} is declared as {name} {shape}, given {t.name} {t.shape}")
        data = file_bytes(t).reshape(-1).view(np.uint8)
        if data.size != t.nbytes():
            raise ValueError(f"GGUF tensor {t.name}: {data.size} bytes for a {t.type} tensor of shape {t.shape}")
        at = self._data_start + self._offset
        _write_at(self._fd, data, at)
        if self.verify and not np.array_equal(_read_back(self._fd, at, data.size), data):
            self.abort()
            raise OSError(f"{self.path}: the GGUF file read back differs from what was written: {t.name} holds "
                          f"other bytes than were written; nothing was put in place")
        self._written.append((t.type, data.size))
        self._offset += _pad(data.size, self.alignment)

    def finish(self, metadata: Mapping[str, Any] | None = None) -> Path:
        """Writes the header (with ``metadata`` when given: the same keys, values of the same encoded sizes), checks
        the file (``verify``) and puts it in place. Returns the path."""
        if len(self._written) != len(self.layout):
            raise ValueError(f"{self.path}: {len(self._written)} of {len(self.layout)} tensors written; next "
                             f"{self.next_name}")
        try:
            header = self._header(metadata if metadata is not None else self._metadata, self._written)
            if len(header) != self._header_size:
                raise ValueError(f"{self.path}: the final header takes {len(header)} bytes, the space kept for it "
                                 f"{self._header_size} (metadata values changed size)")
            _write_at(self._fd, np.frombuffer(header, np.uint8), 0)
            os.ftruncate(self._fd, self._data_start + self._offset)
            os.close(self._fd)
            self._fd = None
            if self.verify:
                self._check_header()
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(self._tmp, 0o666 & ~umask)  # as a plain open() would have made it (mkstemp makes 0600)
            os.replace(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        """Closes and removes the temporary file (nothing is put in place)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def _header(self, metadata, types: list) -> bytes:
        """The header bytes (magic to tensor infos) for ``types`` [(type name, nbytes)] per tensor."""
        typed = typed_metadata(self.arch, metadata)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.header.", dir=self.path.parent)
        os.close(fd)
        try:
            writer = gguf.GGUFWriter(tmp, self.arch)
            if self.alignment != 32:
                writer.add_custom_alignment(self.alignment)
            for key, value, vtype, sub in typed:
                writer.add_key_value(key, value, vtype, sub_type=sub)
            for (name, shape), (kind, nbytes) in zip(self.layout, types):
                _add_info(writer, name, shape, kind, nbytes)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            writer.close()
            return Path(tmp).read_bytes()
        finally:
            os.unlink(tmp)

    def _check_header(self) -> None:
        """Raises OSError unless the gguf package reads every tensor back under its name, type, shape and place."""
        try:
            reader = gguf.GGUFReader(self._tmp)
            found = {t.name: t for t in reader.tensors}
        except Exception as exc:  # a short file, a header that does not parse
            raise OSError(f"{self.path}: the GGUF file written cannot be read back ({type(exc).__name__}: {exc}); "
                          f"nothing was put in place") from exc
        problems, offset = [], 0
        for (name, shape), (kind, nbytes) in zip(self.layout, self._written):
            got = found.get(name)
            want_type = ggml_type(kind)
            if got is None:
                problems.append(f"{name} is missing")
            elif got.tensor_type != want_type:
                problems.append(f"{name} has type {got.tensor_type.name}, not {want_type.name}")
            elif (tuple(int(n) for n in got.shape[::-1]) != shape or int(got.n_bytes) != nbytes
                  or int(got.data_offset) != self._data_start + offset):
                problems.append(f"{name} is not where or as large as it was written")
            offset += _pad(nbytes, self.alignment)
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise OSError(f"{self.path}: the GGUF file read back differs from what was written: "
                          f"{'; '.join(problems[:5])}{more}; nothing was put in place")


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _write_at(fd: int, data: np.ndarray, at: int) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + (1 << 30)], at + done)


def _read_back(fd: int, at: int, n: int) -> np.ndarray:
    """``n`` bytes of the file at ``at`` (the check's reading of what was written)."""
    out = np.empty(n, np.uint8)
    view = memoryview(out)
    done = 0
    while done < n:
        got = os.preadv(fd, [view[done:done + (1 << 30)]], at + done)
        if got <= 0:
            raise OSError(f"short read at byte {at + done}")
        done += got
    return out


def _add_info(writer: gguf.GGUFWriter, name: str, shape: tuple, kind: str, nbytes: int):
    if kind in ("f32", "f16"):
        writer.add_tensor_info(name, shape, np.dtype(np.float32 if kind == "f32" else np.float16), nbytes)
    else:
        qtype = ggml_type(kind)
        writer.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, qtype), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
