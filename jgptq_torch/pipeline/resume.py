"""Runs that survive a crash: the layerwise pipeline's state, written after every decoder layer.

``quantize_moe(model, calib, checkpoint_dir="out.work")`` keeps in that folder, after each finished layer:

- ``layer-<i>.safetensors``: the layer's quantized records (codes, scales, zeros, g_idx and grid facts in the
  header; GGML payload bytes and their format) and its importance statistic (imatrix entries), and
  ``layer-<i>.json``: its part of the report (per-matrix records, expert coverage, warnings, times);
- ``inputs-<i+1>.safetensors``: the next layer's input activations (one tensor per calibration batch, with the
  state the previous layer hands it, :mod:`jgptq_torch.pipeline.layer_state`);
- ``state.json``: how many layers are done, and the run's fingerprint: the model (config, class, a BLAKE2 hash of
  every weight), the calibration tokens (hash of ids and masks) and the configuration (every field but those of
  ``jgptq.config.RUN_FIELDS``: progress bars, offload mode and folder, device budget; ``PipelineConfig.what()``),
  kept also field by field so that a refusal names the settings that changed.

Every file is written under a temporary name and renamed into place, ``state.json`` last, so a run killed at any
moment leaves the state of its last finished layer. Started again with the same model, data and configuration,
the run re-applies the stored weights of the finished layers (dequantized records written back exactly as the
first run wrote them), loads the stored activations and continues with the next layer: the results are the same
bytes as an uninterrupted run's. A fingerprint that differs raises :class:`ResumeMismatchError` naming what
changed; ``resume=False`` discards the state and starts over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch

from jgptq_torch.pipeline import layer_state
from jgptq_torch.report import ModuleRecord
from jgptq_torch.write_errors import writing
from jgptq.export.records import GGMLWeight, QuantizedWeight
from jgptq.imatrix import ImatrixEntry
from jgptq.version import __version__

STATE = "state.json"
FORMAT_VERSION = 2
_OWN_FILE = re.compile(r"^(state\.json|layer-\d{5}\.(safetensors|json)|inputs-\d{5}\.safetensors)(\.tmp-\d+)?$")
_RECORD_FIELDS = ("bits", "group_size", "sym", "act_order", "scale_dtype", "method", "transposed")
_ARRAYS = ("codes", "scales", "zeros", "g_idx")
_GGML_FIELDS = ("format", "method", "transposed")


class ResumeMismatchError(ValueError):
    """The checkpoint folder holds the state of a run with another model, calibration set or configuration."""


def _hash_tensor(h, name: str, t: torch.Tensor) -> None:
    t = t.detach().to("cpu").contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(memoryview(t.view(-1).view(torch.uint8).numpy()))


def fingerprint(model, batch_list, cfg, layer_count: int, imatrix=None, model_digest=None) -> dict:
    """What a run depends on, as hex digests: ``model`` (class, config, every state_dict tensor, or instead
    ``model_digest``: a streamed model's checkpoint digest), ``calibration`` (the batches' ids and masks),
    ``config`` (the :class:`~jgptq.config.PipelineConfig` without ``progress``, and a given ``imatrix``'s sums and
    counts)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(model).__name__.encode())
    h.update(json.dumps(model.config.to_diff_dict(), sort_keys=True, default=str).encode())
    if model_digest is not None:
        h.update(f"checkpoint|{model_digest}".encode())
    else:
        for name, t in model.state_dict().items():
            _hash_tensor(h, name, t)
    c = hashlib.blake2b(digest_size=16)
    for b, batch in enumerate(batch_list):
        _hash_tensor(c, f"ids{b}", batch.input_ids)
        _hash_tensor(c, f"mask{b}", batch.attention_mask)
    settings = cfg.what()  # progress bars and where layers live do not change the results
    k = hashlib.blake2b(json.dumps(settings, sort_keys=True, default=str).encode(), digest_size=16)
    for name in sorted(imatrix or {}):
        for what, arr in (("sums", imatrix[name].sums), ("counts", imatrix[name].counts)):
            arr = np.ascontiguousarray(arr, np.float32)
            k.update(f"{name}|{what}|{arr.shape}|".encode())
            k.update(arr.tobytes())
    return {"model": h.hexdigest(), "calibration": c.hexdigest(), "config": k.hexdigest(),
            "layers": int(layer_count), "jgptq": __version__, "settings": _flat_settings(settings)}


def _flat_settings(settings: dict, prefix: str = "") -> dict:
    """``cfg.what()`` as JSON values keyed by dotted field names (``quant.group_size``), kept in the state so that
    a refusal can name the settings that changed (the ``config`` digest alone decides)."""
    flat = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flat_settings(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = json.loads(json.dumps(value, default=str))
    return flat


def changed_settings(old: dict, new: dict) -> str:
    """The settings of two fingerprints that differ, as ``"quant.format 'int' then, 'q4_k' now; ..."``; empty
    when an older state holds none or only a given importance matrix differs."""
    before, now = old.get("settings"), new.get("settings")
    if not isinstance(before, dict) or not isinstance(now, dict):
        return ""
    missing = object()
    names = sorted(k for k in set(before) | set(now) if before.get(k, missing) != now.get(k, missing))
    return "; ".join(f"{k} {before.get(k)!r} then, {now.get(k)!r} now" for k in names)


def _replace_into(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with writing(path):   # a full disk or another OS error names the file
            write(tmp)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _record_dict(r: ModuleRecord) -> dict:
    d = dataclasses.asdict(r)
    d["shape"] = list(d["shape"])
    return d


class Checkpoint:
    """The state folder of one run (see the module docstring).

    Args:
      directory: the folder (created if needed; only jgptq's own files in it are ever removed).
      fingerprint: :func:`fingerprint` of this run.
      resume: continue a matching state (True) or discard any state and start over (False).
    """

    def __init__(self, directory, fingerprint: dict, resume: bool = True):
        self.dir = Path(directory)
        self.fingerprint = dict(fingerprint)
        self.resume = bool(resume)

    # -- opening -----------------------------------------------------------------------------------------------
    def open(self) -> int:
        """Number of finished layers to take over (0: start from the first layer).

        Raises:
          ResumeMismatchError: a state of another run (with ``resume=True``).
        """
        if self.dir.exists() and not self.dir.is_dir():
            raise FileExistsError(f"checkpoint_dir {str(self.dir)!r} exists and is not a folder")
        self.dir.mkdir(parents=True, exist_ok=True)
        state_path = self.dir / STATE
        if not self.resume or not state_path.exists():
            self.clear()
            return 0
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError) as exc:
            raise ResumeMismatchError(f"{state_path}: unreadable resume state ({exc}); start over with "
                                      f"resume=False (command line: --no-resume)") from exc
        old = state.get("fingerprint", {})
        diff = [k for k in ("model", "calibration", "config", "layers", "jgptq") if old.get(k) !=
                self.fingerprint.get(k)]
        if state.get("version") != FORMAT_VERSION or diff:
            what = {"model": "the model (config or weights)", "calibration": "the calibration tokens",
                    "config": "the quantization settings", "layers": "the number of decoder layers",
                    "jgptq": "the jgptq version"}
            reasons = ", ".join(what[k] for k in diff) or "the state format"
            if "config" in diff:
                changed = changed_settings(old, self.fingerprint)
                reasons += f" ({changed})" if changed else (" (the given importance matrix)"
                                                            if "settings" in old else "")
            raise ResumeMismatchError(
                f"{self.dir} holds the state of another run ({reasons} differ, after {state.get('layers_done')} "
                f"finished layers); refusing to mix them. Start over with resume=False (command line: "
                f"--no-resume), or use another output folder")
        done = int(state["layers_done"])
        for i in range(done):
            for suffix in (".safetensors", ".json"):
                if not self._layer(i, suffix).exists():
                    raise ResumeMismatchError(f"{self.dir}: {self._layer(i, suffix).name} is missing; start over "
                                              f"with resume=False (command line: --no-resume)")
        return done

    def clear(self) -> None:
        """Removes jgptq's state files from the folder (nothing else)."""
        for p in self.dir.iterdir():
            if p.is_file() and _OWN_FILE.match(p.name):
                p.unlink()

    def _layer(self, i: int, suffix: str) -> Path:
        return self.dir / f"layer-{i:05d}{suffix}"

    def _inputs(self, i: int) -> Path:
        return self.dir / f"inputs-{i:05d}.safetensors"

    # -- writing -----------------------------------------------------------------------------------------------
    def save_layer(self, i: int, weights: dict, report_part: dict, next_hidden, imatrix=None,
                   float_hidden=None) -> None:
        """Stores layer ``i``'s records (checkpoint key -> QuantizedWeight or GGMLWeight), its importance statistic
        (parameter name -> ImatrixEntry), its report part and (unless it was the last layer) the next layer's
        inputs (and those of the float model's stream, ``float_hidden``, when the run carries it), then marks the
        layer finished."""
        from safetensors.numpy import save_file as save_numpy
        from safetensors.torch import save_file as save_torch

        arrays, meta = {}, {}
        for key, rec in weights.items():
            if isinstance(rec, GGMLWeight):
                meta[key] = dict({f: getattr(rec, f) for f in _GGML_FIELDS}, kind="ggml")
                arrays[f"{key}|payload"] = np.ascontiguousarray(rec.payload)
                continue
            meta[key] = {f: getattr(rec, f) for f in _RECORD_FIELDS}
            for a in _ARRAYS:
                arrays[f"{key}|{a}"] = np.ascontiguousarray(getattr(rec, a))
        stats = sorted(imatrix or {})
        for name in stats:
            arrays[f"{name}|imatrix_sums"] = np.ascontiguousarray(imatrix[name].sums, np.float32)
            arrays[f"{name}|imatrix_counts"] = np.ascontiguousarray(imatrix[name].counts, np.float32)
        header = {"records": json.dumps(meta), "imatrix": json.dumps(stats)}
        _replace_into(self._layer(i, ".safetensors"), lambda p: save_numpy(arrays, str(p), metadata=header))
        _replace_into(self._layer(i, ".json"), lambda p: p.write_text(json.dumps(report_part)))
        if next_hidden is not None:
            tensors, layouts = {}, {}   # with the state each stream hands the next layer
            for name, h in [(str(b), h) for b, h in enumerate(next_hidden)] + \
                    [(f"float.{b}", h) for b, h in enumerate(float_hidden or ())]:
                tensors[name] = h.detach().to("cpu").contiguous()
                more, where = layer_state.stored_state(name, h)
                tensors.update(more)
                layouts.update(where)
            _replace_into(self._inputs(i + 1), lambda p: save_torch(tensors, str(p),
                                                                    metadata={"state": json.dumps(layouts)}))
        state = {"version": FORMAT_VERSION, "layers_done": i + 1, "fingerprint": self.fingerprint}

        def write_state(p: Path):
            with open(p, "w") as fh:
                json.dump(state, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())

        _replace_into(self.dir / STATE, write_state)
        self._inputs(i).unlink(missing_ok=True)

    # -- reading -----------------------------------------------------------------------------------------------
    def load_layer(self, i: int) -> tuple[dict, dict]:
        """(checkpoint key -> QuantizedWeight or GGMLWeight, report part) of finished layer ``i``; the part holds
        the layer's importance statistic under ``"imatrix"`` (parameter name -> ImatrixEntry)."""
        from safetensors import safe_open

        path = self._layer(i, ".safetensors")
        weights = {}
        with safe_open(str(path), framework="numpy") as f:
            header = f.metadata()
            for key, fields in json.loads(header["records"]).items():
                if fields.pop("kind", None) == "ggml":
                    weights[key] = GGMLWeight(f.get_tensor(f"{key}|payload"), **fields)
                else:
                    weights[key] = QuantizedWeight(**{a: f.get_tensor(f"{key}|{a}") for a in _ARRAYS}, **fields)
            stats = {name: ImatrixEntry(f.get_tensor(f"{name}|imatrix_sums"), f.get_tensor(f"{name}|imatrix_counts"))
                     for name in json.loads(header.get("imatrix", "[]"))}
        part = json.loads(self._layer(i, ".json").read_text())
        part["imatrix"] = stats
        return weights, part

    def load_hidden(self, i: int, device, stream: str = "replay") -> list:
        """The stored inputs of layer ``i``, one tensor per calibration batch, on ``device``: the run's
        (``stream="replay"``) or the float model's stream (``"float"``)."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = self._inputs(i)
        if not path.exists():
            raise ResumeMismatchError(f"{path.name} is missing from {self.dir}; start over with resume=False "
                                      f"(command line: --no-resume)")
        stored = load_file(str(path))
        with safe_open(str(path), "pt") as f:
            layouts = json.loads((f.metadata() or {}).get("state", "{}"))
        prefix = "float." if stream == "float" else ""
        count = sum(1 for k in stored if k.startswith(prefix) and k[len(prefix):].isdigit())
        if not count:
            raise ResumeMismatchError(f"{path.name} in {self.dir} holds no inputs of the {stream} stream; start "
                                      f"over with resume=False (command line: --no-resume)")
        return [layer_state.restore_state(stored[f"{prefix}{b}"].to(device), f"{prefix}{b}", stored, layouts,
                                          device)
                for b in range(count)]


def report_part(report, layer: int, prefix: str, marks: tuple) -> dict:
    """What layer ``layer`` added to ``report`` since ``marks`` = (records, warnings) counts, as JSON data."""
    n_rec, n_warn = marks
    base = f"{prefix}.{layer}."
    return {"records": [_record_dict(r) for r in report.records[n_rec:]],
            "warnings": report.warnings[n_warn:],
            "coverage": {k: v for k, v in report.coverage.items() if k.startswith(base)},
            "thresholds": {k: v for k, v in report.thresholds.items() if k.startswith(base)},
            "timings": report.timings.get(layer, {})}


def _nan(v):
    return float("nan") if v is None else v


def restore_layer(ckpt: Checkpoint, layer: int, target, prefix: str, names: dict, result) -> None:
    """Takes finished layer ``layer`` over from ``ckpt``: its records and report part go into ``result``, and
    its dequantized weights are written into the model's parameters (as the pipeline's write step does)."""
    weights, part = ckpt.load_layer(layer)
    result.weights.update(weights)
    result.imatrix.update(part["imatrix"])
    report = result.report
    for d in part["records"]:
        d = dict(d, shape=tuple(d["shape"]), loss=_nan(d["loss"]), damp_used=_nan(d["damp_used"]))
        report.records.append(ModuleRecord(**d))
    report.warnings.extend(part["warnings"])
    report.coverage.update(part["coverage"])
    report.thresholds.update(part["thresholds"])
    for stage, seconds in part["timings"].items():
        report.add_time(layer, stage, seconds)
    base = f"{prefix}.{layer}"
    for m in target.matrices():
        dst = m.weight()
        full = np.zeros(tuple(dst.shape), np.float32)
        n, r, c = full.shape
        for key, expert, rows in names[m.param_name(base)]:
            if key not in weights:
                raise ResumeMismatchError(f"{ckpt.dir}: layer {layer} holds no record for {key}; start over with "
                                          f"resume=False (command line: --no-resume)")
            deq = weights[key].dequantize()
            rows = rows.numpy()
            if expert is not None:
                full[expert][rows] = deq
            elif n == 1:
                full[0][rows] = deq
            else:
                full.reshape(n * r, c)[rows] = deq.reshape(-1, c)
        src = torch.from_numpy(full)
        with torch.no_grad():
            dst.copy_(src.to(device=dst.device, dtype=dst.dtype))

