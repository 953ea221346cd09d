"""The GGUF file of a run written while the run goes: each decoder layer's tensors as soon as its records exist.

:class:`GGUFSink` is handed to :func:`jgptq.quantize_moe` (``sink=``). The file's tensors and the size of its
header are known before the first layer (:class:`jgptq_torch.export.gguf.export.GGUFFile`; a GGUF header does not grow with
the tensors' types), so a writer thread puts each layer's blocks at their final place in the file
(:class:`jgptq.export.gguf.GGUFStream`) while the next layers are calibrated and solved. When the run ends only
the token embedding and the output head (llama.cpp's types for the run, encoded then), the final norm and the
header are left to write. The file is the one :func:`jgptq_torch.export.gguf.export.export_gguf` writes for the same run,
byte for byte.

Example::

    sink = GGUFSink("model-q4_k.gguf", tokenizer=tokenizer)
    result = jgptq.quantize_moe(model, calib, QuantConfig(format="q4_k"), sink=sink)
    sink.path            # the file, read back and checked
"""

from __future__ import annotations

from jgptq.surface import option

import re
import threading
from collections import Counter
from pathlib import Path

from jgptq_torch.export.gguf.edges import edge_choices, encode_edges, report_edges
from jgptq_torch.export.checkpoint import check_format
from jgptq_torch.export.gguf.export import GGUFFile, output_path
from jgptq_torch.export.gguf.records import (check_ggml, count_formats, format_weights, param_record,
                                             record_formats, row_places)
from jgptq_torch.write_errors import writing
from jgptq.export.gguf import GGUFStream

_LAYER = re.compile(r"\.layers\.\d+\.")


def _layer_of(param: str) -> str:
    """The ``.layers.N.`` part of a parameter name (the name itself outside the decoder layers)."""
    found = _LAYER.search(param)
    return found.group(0) if found else param


class GGUFSink:
    """Writes a run's GGUF file as its layers finish (see the module). A parameter's records leave the sink once
    its tensors are written (the run's ``result.weights`` keeps them unless the sink ``releases_records``).

    Args:
      out: the file (ending in ``.gguf``) or a folder that gets ``model.gguf``.
      overwrite: replace an existing file.
      tokenizer, float_type, file_type, name, float_embeddings, verify: as :func:`jgptq_torch.export.gguf.export.export_gguf`.
    """

    def __init__(self, out="model.gguf", *, overwrite: bool = False, tokenizer=None, float_type: str = "f16",
                 file_type: int | None = None, name: str | None = None, float_embeddings: bool = False,
                 verify: bool = True):
        self.path = output_path(out)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} exists; pass {option('overwrite')} to replace it")
        self._options = dict(overwrite=overwrite, verify=verify)
        self._tokenizer, self._float_type, self._file_type = tokenizer, float_type, file_type
        self._name, self._float_embeddings = name, float_embeddings
        self._cond = threading.Condition()
        self._weights: dict = {}          # checkpoint key -> record, as layers finish, until written
        self._sizes: dict = {}            # checkpoint key -> (format, weights) of every record that came
        self._edges = None                # parameter -> record of the embedding / head, once the run ends
        self._error: BaseException | None = None
        self._stream = self._thread = self._early = None
        self.written = None

    def start(self, model, result) -> None:
        """Called by the pipeline once the run's plan is known (``result``: its QuantizeResult, records of
        restored layers included); opens the file and starts the writer thread."""
        if self._stream is not None:
            raise ValueError(f"this GGUFSink already took a run (its file {self.path}); make a new one for each run")
        quant = getattr(getattr(result, "config", None), "quant", None)
        check_format("gguf", quant)    # an integer-grid run, refused before its first layer
        file = GGUFFile(model, tokenizer=self._tokenizer, float_type=self._float_type)
        keys = {p: list(k) for p, k in (result.param_keys or {}).items()}
        for param in keys:
            if param not in file.params:
                raise ValueError(f"result.param_keys names {param!r}, which is not a parameter of the model")
            if not file.plan[param]:
                raise ValueError(f"{param}: a quantized parameter with no GGUF tensor of its own (a tied output head); "
                                 f"export the finished run with export_gguf instead")
        self._file, self._keys = file, keys
        self._indirect = {p for p, k in keys.items() if len(k) != 1 or k[0] != p}   # kept per checkpoint key
        self._users = Counter(k for ks in keys.values() for k in ks)        # key -> parameters not yet written
        self._left = {p: len(e) for p, e in file.plan.items() if e}       # parameter -> its tensors not yet written
        self._places = {}                 # their rows' checkpoint places, found by the writer as it needs them
        entries = file.entries()
        self._entries = entries
        meta = file.metadata(result, record_formats([]), self._file_type if self._file_type is not None else 0,
                             self._name)
        self._stream = GGUFStream(self.path, file.spec.name, meta, [(t.name, file.shape(p, t)) for p, t in entries],
                                  **self._options)
        self.add(result.weights)
        self._thread = threading.Thread(target=self._work, name="jgptq-gguf", daemon=True)
        self._thread.start()
        self._early = None
        if self.early_edges and not self._float_embeddings and quant is not None:   # on a guess: the run's format
            guess = edge_choices(result, file.plan, file.state, keys, Counter({quant.format: 1}))
            if guess:
                self._early = (guess, {}, threading.Thread(target=self._encode_early, args=(guess,),
                                                           name="jgptq-gguf-edges", daemon=True))
                self._early[2].start()

    def _encode_early(self, guess: dict) -> None:
        with self._cond:   # after the first layer, whose compiling it would otherwise slow down
            self._cond.wait_for(lambda: self._sizes or self._error is not None or self._edges is not None)
        try:
            self._early[1].update(encode_edges(self._file.state, guess))
        except Exception:   # encoded again at the end, where an error is reported
            self._early[1].clear()

    def add(self, records: dict) -> None:
        """Records of finished layers (checkpoint key -> record), from any thread."""
        check_ggml(records)
        with self._cond:
            self._weights.update(records)
            self._sizes.update((k, format_weights(rec)) for k, rec in records.items())
            self._cond.notify_all()

    def finish(self, result) -> Path:
        """Called by the pipeline when every layer is done: encodes the embedding and the head, waits for the
        writer, writes the header and puts the file in place. Returns its path."""
        file = self._file
        with self._cond:
            sizes = dict(self._sizes)
        missing = sorted(k for keys in self._keys.values() for k in keys if k not in sizes)
        if missing:
            self.abort()
            raise ValueError(f"the run's records {missing[:4]} never reached the GGUF file")
        formats = count_formats(sizes[k] for keys in self._keys.values() for k in keys)   # export_gguf's order
        choices = ({} if self._float_embeddings else
                   edge_choices(result, file.plan, file.state, self._keys, formats))
        edges = {}
        if self._early is not None:
            guess, encoded, thread = self._early
            thread.join()
            edges = {p: encoded[p] for p, c in choices.items() if c.same(guess.get(p)) and p in encoded}
        edges.update(encode_edges(file.state, {p: c for p, c in choices.items() if p not in edges}))
        report_edges(result, file.plan, file.state, choices)
        with self._cond:
            self._edges = edges
            self._cond.notify_all()
        self._thread.join()
        if self._error is not None:
            error = self._error
            self.abort()
            with writing(self.path):   # a full disk or a read-only folder: named as the file's failure
                raise error
        meta = file.metadata(result, formats, self._file_type, self._name)
        self.written = self._stream.finish(meta)
        return self.written

    def abort(self) -> None:
        """Stops the writer and removes the unfinished file (the pipeline calls it when the run fails)."""
        with self._cond:
            if self._error is None:
                self._error = RuntimeError("the run stopped before its GGUF file was complete")
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._stream is not None:
            self._stream.abort()

    def _record(self, param: str):
        """The parameter's record once every key of it has come (None for a parameter left in float)."""
        keys = self._keys.get(param)
        with self._cond:
            if keys is not None:
                self._cond.wait_for(lambda: self._error is not None or all(k in self._weights for k in keys))
                weights = {k: self._weights[k] for k in keys if k in self._weights}
            else:
                self._cond.wait_for(lambda: self._error is not None or self._edges is not None)
                return None if self._error is not None else self._edges.get(param)
        if self._error is not None:
            return None
        rec = param_record(param, self._file.params[param], keys, weights, self._places_of(param))
        self._file.check_record(param, rec)
        return rec

    def _places_of(self, param: str):
        """The checkpoint places of ``param``'s rows (None when one record holds it whole), found for every
        parameter of its decoder layer at once (finding them costs about 15 ms a parameter)."""
        if param not in self._indirect:
            return None
        if param not in self._places:
            layer = _layer_of(param)
            group = [p for p in self._indirect if p not in self._places and _layer_of(p) == layer]
            self._places.update(row_places(self._file.model, group))
        return self._places[param]

    def _work(self) -> None:
        try:
            for param, t in self._entries:
                wanted = (param is not None and param in self._keys) or self._is_edge(t)
                rec = self._record(param) if wanted else None
                if self._error is not None:
                    return
                if rec is None and param is not None:
                    self._ready(param)
                    if self._error is not None:
                        return
                self._stream.write(self._file.tensor(param, t, rec))
                if param is not None:
                    self._written(param)
        except BaseException as exc:  # handed to finish(), which raises it in the pipeline's thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    early_edges = True   # the embedding and head are encoded beside the layers, on a guess of the run's formats

    def _ready(self, param: str) -> None:
        """Called by the writer before a float tensor of ``param`` is written: its values are in the model."""

    def _written(self, param: str) -> None:
        """Called by the writer after each tensor of ``param``: once all are written, its records leave."""
        self._left[param] -= 1
        if self._left[param] or param not in self._keys:
            return
        with self._cond:
            for k in self._keys[param]:
                self._users[k] -= 1
                if not self._users[k]:
                    self._weights.pop(k, None)

    @staticmethod
    def _is_edge(t) -> bool:
        return t.role in ("embedding", "output")
