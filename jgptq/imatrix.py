"""llama.cpp's importance statistic ("imatrix") and its files.

The statistic of a weight W (out x in) is, per input column j, the sum of squares of the column's inputs over the
calibration tokens the weight saw, and the number of those tokens: ``sums[j] = sum_t x_tj^2``, ``count``. For a
stack of experts (E, out, in) there is one row of sums and one count per expert, over the tokens ROUTED to that
expert only. llama.cpp's encoders take ``sums / count`` as their per-column importance (an expert that saw no
token gets 1.0 for every column, as ``llama-quantize`` does). The Hessian diagonal of GPTQ is twice that value.

Files (``llama-imatrix``'s formats):

- GGUF (the default of llama.cpp): key ``general.type = "imatrix"``, ``imatrix.datasets`` (array of strings),
  ``imatrix.chunk_count`` and ``imatrix.chunk_size`` (u32); per weight ``<name>.in_sum2`` F32 of GGML shape
  {ne0 = in, n_mat = E} (the raw sums) and ``<name>.counts`` F32 of shape {1, E} (token counts);
- legacy ``.dat`` (read only): int32 entry count; per entry int32 name length, name, int32 ncall, int32 nval,
  float32[nval] = (sum / count) * ncall; an optional trailer (int32 chunk count, int32 length, dataset name).

Names are whatever the caller uses: the layerwise pipeline keys its statistic by model parameter name
(``model.layers.0.mlp.experts.gate_up_proj``); a GGUF model exporter writes GGUF tensor names
(``blk.0.ffn_up_exps.weight``), the names ``llama-quantize`` looks up.
"""

from __future__ import annotations

from jgptq.surface import option

import os
import struct
from typing import Mapping, NamedTuple

import numpy as np

SUM_SUFFIX = ".in_sum2"
COUNT_SUFFIX = ".counts"


class ImatrixEntry(NamedTuple):
    """The statistic of one weight.

    Attributes:
      sums: float32 (E, C): per expert (E = 1 for a dense weight), per input column, the raw sum of squared inputs.
      counts: float32 (E,): tokens each row of ``sums`` was summed over.
    """

    sums: np.ndarray
    counts: np.ndarray

    def values(self) -> np.ndarray:
        """float32 (E, C): ``sums / counts`` per expert (float32 division, as llama-quantize); an expert with no
        token gets 1.0 for every column (llama-quantize's convention)."""
        sums = np.asarray(self.sums, np.float32)
        counts = np.asarray(self.counts, np.float32)
        out = np.ones_like(sums)
        seen = counts > 0
        out[seen] = sums[seen] / counts[seen, None]
        return out


def hessian_importance(hessian, tokens, n: int) -> np.ndarray:
    """float32 (n, C): the Hessian diagonal (``2/N sum x^2``) as the per-column importance of the GGML encoders,
    with 1.0 in every column of a matrix that saw no token (llama.cpp's convention, as :meth:`ImatrixEntry.values`).

    Args:
      hessian: float32 (C, C) shared by the n matrices, or (n, C, C); tokens: the n token counts behind it.
    """
    import jax.numpy as jnp

    diag = np.asarray(jnp.diagonal(jnp.asarray(hessian), axis1=-2, axis2=-1), np.float32)
    diag = np.broadcast_to(diag.reshape(-1, diag.shape[-1]), (n, diag.shape[-1])).copy()
    diag[np.asarray(tokens).reshape(-1) == 0] = 1.0
    return diag


def _entry(name: str, entry) -> ImatrixEntry:
    sums, counts = np.asarray(entry[0], np.float32), np.asarray(entry[1], np.float32)
    if sums.ndim == 1:
        sums = sums[None]
    counts = counts.reshape(-1)
    if sums.ndim != 2 or counts.shape != (sums.shape[0],):
        raise ValueError(f"imatrix entry {name!r}: sums must be (E, C) and counts (E,), got {sums.shape} and "
                         f"{counts.shape}")
    if not (np.all(np.isfinite(sums)) and np.all(np.isfinite(counts))) or sums.min(initial=0) < 0 \
            or counts.min(initial=0) < 0:
        raise ValueError(f"imatrix entry {name!r}: sums and counts must be finite and >= 0")
    return ImatrixEntry(sums, counts)


def write_imatrix(path, entries: Mapping[str, ImatrixEntry], *, datasets=(), chunk_count: int = 0,
                  chunk_size: int = 0, overwrite: bool = False) -> str:
    """Writes a GGUF imatrix file as ``llama-imatrix`` does (read by ``llama-quantize --imatrix``).

    Args:
      path: the file to write.
      entries: weight name -> :class:`ImatrixEntry` (or a (sums, counts) pair); names are written as given.
      datasets: names of the calibration data sets (``imatrix.datasets``).
      chunk_count, chunk_size: ``imatrix.chunk_count`` / ``imatrix.chunk_size`` (llama.cpp's chunks of tokens;
        informational).
      overwrite: replace an existing file.
    Returns:
      The path written.
    Raises:
      ValueError: no entries, a malformed entry; FileExistsError: the file exists and not ``overwrite``.
    """
    import gguf

    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"imatrix file {path!r} already exists; pass {option('overwrite')} to replace it")
    if not entries:
        raise ValueError("write_imatrix: no entries to write")
    if isinstance(datasets, str):
        datasets = (datasets,)
    writer = gguf.GGUFWriter(path, arch="")
    writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)  # llama-imatrix writes none
    writer.add_type(gguf.GGUFType.IMATRIX)
    writer.add_array(gguf.Keys.IMatrix.DATASETS, [str(d) for d in datasets])
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, int(chunk_count))
    writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, int(chunk_size))
    for name in sorted(entries):
        e = _entry(name, entries[name])
        writer.add_tensor(name + SUM_SUFFIX, np.ascontiguousarray(e.sums))             # GGML {C, E}
        writer.add_tensor(name + COUNT_SUFFIX, np.ascontiguousarray(e.counts[:, None]))  # GGML {1, E}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _field_value(field):
    from gguf import GGUFValueType

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [bytes(field.parts[i]).decode("utf-8") if field.types[-1] == GGUFValueType.STRING
                else field.parts[i][0].item() for i in field.data]
    if field.types and field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]][0].item()


def read_imatrix(path) -> tuple[dict, dict]:
    """Reads an imatrix file: GGUF (jgptq's and llama.cpp's) or llama.cpp's legacy ``.dat``.

    Returns:
      (name -> :class:`ImatrixEntry`, metadata dict with ``datasets``, ``chunk_count``, ``chunk_size`` and
      ``legacy``). GGUF counts are rounded to integers as llama.cpp reads them. A legacy entry has one row of
      ``nval`` stored values (experts flattened) and its ``ncall`` as the count, so :meth:`ImatrixEntry.values`
      gives llama.cpp's values.
    Raises:
      ValueError: not an imatrix file, or sums without counts.
    """
    path = os.fspath(path)
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        return _read_legacy(path)
    import gguf

    reader = gguf.GGUFReader(path)
    meta = {"datasets": [], "chunk_count": 0, "chunk_size": 0, "legacy": False}
    for key, short in ((gguf.Keys.IMatrix.DATASETS, "datasets"), (gguf.Keys.IMatrix.CHUNK_COUNT, "chunk_count"),
                       (gguf.Keys.IMatrix.CHUNK_SIZE, "chunk_size"), (gguf.Keys.General.TYPE, "type")):
        field = reader.get_field(key)
        if field is not None:
            meta[short] = _field_value(field)
    sums, counts = {}, {}
    for t in reader.tensors:
        if t.name.endswith(SUM_SUFFIX):
            sums[t.name[: -len(SUM_SUFFIX)]] = t
        elif t.name.endswith(COUNT_SUFFIX):
            counts[t.name[: -len(COUNT_SUFFIX)]] = t
    if not sums:
        raise ValueError(f"{path}: no '<name>.in_sum2' tensors; not an imatrix file")
    out = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise ValueError(f"{path}: {name!r} has {'sums' if name in sums else 'counts'} but no "
                             f"{'counts' if name in sums else 'sums'}")
        s, c = sums[name], counts[name]
        if s.tensor_type != gguf.GGMLQuantizationType.F32 or c.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: sums and counts of {name!r} must be F32")
        n_mat = int(c.n_elements)
        data = np.asarray(s.data, np.float32).reshape(n_mat, -1)
        cnt = np.round(np.asarray(c.data, np.float32).reshape(-1)).astype(np.float32)
        out[name] = ImatrixEntry(data.copy(), cnt)
    return out, meta


def _read_legacy(path: str) -> tuple[dict, dict]:
    with open(path, "rb") as fh:
        blob = fh.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(blob):
            raise ValueError(f"{path}: truncated legacy imatrix file")
        vals = struct.unpack_from(fmt, blob, pos)
        pos += size
        return vals

    (n,) = take("<i")
    if n < 1:
        raise ValueError(f"{path}: not an imatrix file (neither GGUF nor a legacy .dat with entries)")
    out = {}
    for _ in range(n):
        (length,) = take("<i")
        name = blob[pos:pos + length].decode("utf-8")
        pos += length
        ncall, nval = take("<ii")
        if nval < 1:
            raise ValueError(f"{path}: entry {name!r} has no values")
        vals = np.frombuffer(blob, np.float32, nval, pos).copy()
        pos += 4 * nval
        out[name] = ImatrixEntry(vals[None], np.array([ncall], np.float32))
    meta = {"datasets": [], "chunk_count": 0, "chunk_size": 0, "legacy": True}
    if pos + 8 <= len(blob):
        (meta["chunk_count"],) = take("<i")
        (length,) = take("<i")
        if length > 0:
            meta["datasets"] = [blob[pos:pos + length].decode("utf-8", "replace")]
    return out, meta
