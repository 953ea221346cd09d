"""Checks of a model's weights before any work: safetensors files that can be read, and finite target weights.

- :func:`check_safetensors_files`: every ``*.safetensors`` file of a model folder has a whole header (its 8-byte
  length, a JSON table whose tensors' data lie inside the file with the bytes their dtype and shape need), and
  every shard the index names exists. Reads the headers only (no tensor data).
- :func:`nonfinite_weights` / :func:`check_finite_weights`: NaN or Inf in a weight the plan will quantize, named by
  parameter and, for fused experts, by expert index and projection rows. One reduction per matrix (a float32 sum,
  in which NaN and Inf survive) finds the suspects; only those are counted element by element.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

# Bytes per element of the safetensors dtypes (sub-byte and unknown ones are not size-checked).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_HEADER_LIMIT = 100 * 1024 * 1024   # safetensors' own bound on the JSON header
_LISTED = 8                          # non-finite findings named in one message


class CorruptWeightsError(ValueError):
    """A model weight file that cannot be read whole, or weights holding NaN or Inf."""


def header_problem(path) -> "str | None":
    """What is wrong with the safetensors file ``path`` (a sentence), or None when its header is whole and every
    tensor's data lies inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"it is {size} bytes long, too short for the 8-byte header length a safetensors file starts with"
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > _HEADER_LIMIT:
            return (f"its header length {length:,} runs past the end of the file ({size:,} bytes): the file is "
                    f"truncated or not a safetensors file")
        raw = fh.read(length)
    try:
        table = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return f"its {length:,}-byte header is not JSON ({exc})"
    if not isinstance(table, dict):
        return f"its header is a JSON {type(table).__name__}, not the table of tensors"
    data = size - 8 - length
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            numel = 1
            for d in shape:
                numel *= int(d)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets in the header ({entry!r:.120})"
        if not 0 <= begin <= end:
            return f"tensor {name!r} has data_offsets [{begin}, {end}], not a byte range"
        if end > data:
            return (f"tensor {name!r} ends at byte {end:,} of the data, but the file holds {data:,} bytes of data "
                    f"({end - data:,} missing): the file is truncated")
        need = numel * _DTYPE_BYTES[dtype] if dtype in _DTYPE_BYTES else None
        if need is not None and end - begin != need:
            return (f"tensor {name!r} ({dtype}, shape {list(shape)}) needs {need:,} bytes but its data_offsets "
                    f"[{begin}, {end}] hold {end - begin:,}")
    return None


def check_safetensors_files(model_dir) -> None:
    """Refuses a model folder whose safetensors files cannot be read whole (see :func:`header_problem`) or whose
    ``model.safetensors.index.json`` names a shard that is missing.

    Raises:
      CorruptWeightsError: naming the file and what is wrong with it.
    """
    folder = Path(model_dir)
    advice = "copy or save it again (an interrupted download or copy leaves such files)"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptWeightsError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc}); {advice}")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CorruptWeightsError(f"{index} names {len(missing)} shard(s) missing from {folder}: "
                                      f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}; {advice}")
    for f in sorted(folder.glob("*.safetensors")):
        problem = header_problem(f)
        if problem:
            raise CorruptWeightsError(f"{f} is not a readable safetensors file: {problem}; {advice}")


def _counted(x: torch.Tensor) -> str:
    """``"2 NaN values"``, ``"1 Inf value"``, ``"2 NaN and 1 Inf values"`` for the elements of ``x`` (or "")."""
    nan, inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    parts = [f"{n} {kind}" for n, kind in ((nan, "NaN"), (inf, "Inf")) if n]
    return f"{' and '.join(parts)} value{'s' if nan + inf > 1 else ''}" if parts else ""


def nonfinite_weights(targets, prefix: str, first: int = 0) -> list:
    """Every NaN/Inf finding in the target matrices: a list of sentences such as
    ``"model.layers.5.mlp.experts.gate_up_proj: expert 3 (gate rows) holds 2 NaN values"``.

    Args:
      targets: the :class:`jgptq_torch.models.LayerTargets` of each decoder layer (what the plan will quantize).
      prefix: the decoder layers' qualified name (``model.layers``).
      first: the index of the decoder layer of ``targets[0]`` (a streamed run checks each layer as it is read).
    Each matrix is reduced once per expert (a float32 sum, read in place, no copy of the tensor); only a matrix
    whose sum is not finite is searched element by element. Weights on the meta device (released) are skipped.
    """
    found = []
    for i, target in enumerate(targets, first):
        for m in target.matrices():
            w = m.weight()   # (count, rows, cols) view
            if w.device.type == "meta" or not w.dtype.is_floating_point:
                continue
            with torch.no_grad():
                sums = torch.stack([w[e].sum(dtype=torch.float32) for e in range(m.count)])
                suspects = torch.nonzero(~torch.isfinite(sums)).flatten().tolist()
                for e in suspects:
                    found += _describe(m, w[e], e, m.param_name(f"{prefix}.{i}"))
    return found


def _describe(m, x: torch.Tensor, e: int, param: str) -> list:
    if m.layout is None:
        what = _counted(x)
        return [f"{param} holds {what}"] if what else []
    parts = [("", slice(None))]
    if m.kind == "expert_gate_up" and m.layout.gated:
        parts = list(zip((" (gate rows)", " (up rows)"), m.layout.gate_up_rows()))
    out = []
    for label, rows in parts:
        what = _counted(x[rows])
        if what:
            out.append(f"{param}: expert {e}{label} holds {what}")
    return out


def check_finite_weights(targets, prefix: str, first: int = 0) -> None:
    """Refuses NaN or Inf in any weight the run will quantize (:func:`nonfinite_weights`), before any work.

    Raises:
      CorruptWeightsError: naming the first findings (parameter, expert, projection rows, counts).
    """
    found = nonfinite_weights(targets, prefix, first)
    if not found:
        return
    more = f"; and {len(found) - _LISTED} more" if len(found) > _LISTED else ""
    raise CorruptWeightsError(
        f"weights to quantize hold NaN or Inf values: {'; '.join(found[:_LISTED])}{more}. GPTQ cannot quantize "
        f"them: repair the checkpoint, or leave these weights in floating point with exclude=[...] (command line: "
        f"--exclude)")
