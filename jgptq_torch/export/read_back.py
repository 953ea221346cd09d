"""Reading back a written GPTQ v1 or compressed-tensors checkpoint: does every quantized module decode to the
solver's weights?

:func:`check_written` reopens the folder's safetensors files (through the index), decodes each quantized module
from the stored tensors alone (the formats' own formulas, see :mod:`jgptq.export.gptq_v1` and
:mod:`jgptq.export.compressed_tensors`) and compares it with the record's dequantized weight, exactly: both are
float32 products of the same float16/bfloat16 scales and small integers. A missing tensor, a wrong shape, a
truncated or unreadable file, or a value that differs is one line of the returned list.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jgptq.export import packing
from jgptq.export.common import module_name


class _Stored:
    """The tensors of a checkpoint folder by name (opened lazily, one shard at a time)."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            from safetensors import safe_open

            single = folder / "model.safetensors"
            with safe_open(str(single), "pt") as f:
                self.where = {k: single for k in f.keys()}
        self._open = {}

    def get(self, key: str) -> np.ndarray:
        from safetensors import safe_open

        path = self.where.get(key)
        if path is None:
            raise KeyError(key)
        if path not in self._open:
            self._open = {path: safe_open(str(path), "pt")}     # one shard open at a time
        t = self._open[path].get_tensor(key)
        return (t.float() if t.is_floating_point() else t).numpy()


def _gptq_v1(stored: _Stored, name: str, record) -> np.ndarray:
    rows, cols = record.shape
    bits = record.bits
    codes = packing.unpack_int32(stored.get(f"{name}.qweight"), bits, cols, axis=0).T.astype(np.float32)
    scales = stored.get(f"{name}.scales")                                          # (G, out)
    zeros = packing.unpack_int32(stored.get(f"{name}.qzeros"), bits, rows, axis=1).astype(np.float32) + 1
    g_idx = stored.get(f"{name}.g_idx").astype(np.intp)
    return scales[g_idx].T * (codes - zeros[g_idx].T)


def _compressed(stored: _Stored, name: str, record) -> np.ndarray:
    rows, cols = record.shape
    bits = record.bits
    shape = tuple(int(v) for v in stored.get(f"{name}.weight_shape"))
    if shape != (rows, cols):
        raise ValueError(f"weight_shape {shape}, the record is {(rows, cols)}")
    codes = packing.unpack_int32(stored.get(f"{name}.weight_packed"), bits, cols, axis=1).astype(np.float32)
    scales = stored.get(f"{name}.weight_scale")                                    # (out, G)
    groups = scales.shape[1]
    try:
        g_idx = stored.get(f"{name}.weight_g_idx").astype(np.intp)
    except KeyError:
        g_idx = (np.arange(cols) // (cols // groups)).astype(np.intp)
    try:
        zeros = packing.unpack_int32(stored.get(f"{name}.weight_zero_point"), bits, rows, axis=0).astype(np.float32)
    except KeyError:
        zeros = np.full((rows, groups), float(1 << (bits - 1)), np.float32)
    return scales[:, g_idx] * (codes - zeros[:, g_idx])


_DECODERS = {"gptq": _gptq_v1, "compressed-tensors": _compressed}


def check_written(folder, kind: str, weights: dict) -> list:
    """Mismatches between a written ``kind`` checkpoint in ``folder`` and the records ``weights`` (checkpoint key
    -> :class:`~jgptq.export.QuantizedWeight`), one line each; empty when every module decodes to its record's
    weight exactly."""
    folder = Path(folder)
    try:
        stored = _Stored(folder)
    except Exception as exc:  # an unreadable index or file
        return [f"{folder}: cannot be read back ({type(exc).__name__}: {exc})"]
    decode = _DECODERS[kind]
    problems = []
    for key, record in weights.items():
        name = module_name(key)
        try:
            got = decode(stored, name, record)
        except KeyError as exc:
            problems.append(f"{name}: {exc.args[0]} is missing from the checkpoint")
            continue
        except Exception as exc:  # a truncated file, a shape the record does not have
            problems.append(f"{name}: cannot be decoded ({type(exc).__name__}: {exc})")
            continue
        want = record.dequantize()
        if got.shape != want.shape:
            problems.append(f"{name}: decodes to shape {got.shape}, the solver's weight is {want.shape}")
        elif not np.array_equal(got, want):
            diff = np.abs(got - want)
            problems.append(f"{name}: {int(np.count_nonzero(diff))} of {diff.size} weights differ from the "
                            f"solver's (largest by {float(diff.max()):.3g})")
    return problems
