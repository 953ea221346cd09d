"""A compressed-tensors or GPTQ v1 checkpoint folder written while a streamed run goes: :class:`CheckpointSink`.

The sink is a ``sink=`` of :func:`jgptq.quantize_moe` (as :class:`jgptq_torch.export.gguf.stream.GGUFSink` is),
for a model streamed from its checkpoint folder (:func:`jgptq.quantize_folder`). A writer thread runs the
exporter (:func:`jgptq.export.export_compressed_tensors` / :func:`jgptq.export.export_gptq_v1`, the writers of
:func:`jgptq_torch.export.checkpoint.export_model`) on records that arrive layer by layer: each layer's packed
tensors go into the output shards as soon as the layer's records exist, and the records leave host memory once
written. A decoder layer's unquantized tensors (norms, routers, biases: small) are kept when the layer is
released; the tensors outside the layers (embeddings, final norm, head) are read from the source folder when
the run ends and written last, in the order ``export_model`` writes them. The folder is the one ``export_model``
writes for the same run, byte for byte (``verify`` aside: records are not kept to be read back at the end).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from jgptq_torch.export import checkpoint as ckpt_mod
from jgptq.export import export_compressed_tensors, export_gptq_v1
from jgptq.export.shards import DEFAULT_SHARD_BYTES, check_output_dir

_END = object()


class CheckpointSink:
    """Writes a streamed run's checkpoint folder as its layers finish (see the module).

    Args:
      kind: ``"compressed-tensors"`` or ``"gptq"``.
      out_dir: the output folder (written beside, moved into place when complete).
      layers: the run's :class:`jgptq_torch.source.stream.StreamedLayers` (the skeleton and its checkpoint).
      source_dir: the model folder (tokenizer files and ``generation_config.json`` are copied from it).
      tokenizer: saved into the folder when ``source_dir`` has no tokenizer files.
      overwrite: replace an existing non-empty folder.
      max_shard_bytes: most tensor bytes per safetensors file (default: the exporters').
      **options: passed on to the exporter (``group_actorder=True`` for compressed-tensors; ``workers=N``: threads
        packing records ahead of the writer thread, default :func:`jgptq.export.pool.default_workers`).
    Raises:
      ExportError: an unknown kind (a GGUF file streams with :class:`GGUFSink`); FileExistsError (at
        :meth:`start`, before any layer is read): a non-empty output without ``overwrite``.
    """

    releases_records = True   # the pipeline drops each layer's records once handed here

    def __init__(self, kind: str, out_dir, layers, *, source_dir=None, tokenizer=None, overwrite: bool = False,
                 max_shard_bytes=None, **options):
        if kind not in ("compressed-tensors", "gptq"):
            raise ckpt_mod.ExportError(f"CheckpointSink writes 'compressed-tensors' or 'gptq' folders, not {kind!r}"
                                       f" (a GGUF file streams with GGUFSink)")
        self.kind, self.out, self.layers = kind, Path(out_dir), layers
        self.source_dir, self.tokenizer, self.overwrite = source_dir, tokenizer, overwrite
        self.max_shard_bytes = max_shard_bytes or DEFAULT_SHARD_BYTES
        self.options = options
        self._queue: queue.Queue = queue.Queue()
        self._kept: dict = {}            # decoder layer -> {state name: host tensor} of its unquantized tensors
        self._thread = self._error = self._result = None
        self.written = None
        self.busy_s = None              # the writer's seconds at work (not waiting for records), once finished

    # -- the pipeline's calls -----------------------------------------------------------------------------------
    def start(self, model, result) -> None:
        """Called once the run's plan is known, before any layer is read (``result``: its QuantizeResult,
        restored layers' records included): checks the format and the output folder, starts the writer thread."""
        if self._thread is not None:
            raise ValueError(f"this CheckpointSink already took a run ({self.out}); make a new one for each run")
        quant = result.config.quant
        ckpt_mod.check_format(self.kind, quant)
        check_output_dir(self.out, self.overwrite)
        self.model, self._result = model, result
        self._quantized = set(result.param_keys or {})
        self.layers.on_leave = self._keep
        meta_state = ckpt_mod.checkpoint_state(model, result)          # names, shapes: known before any work
        self._names = list(meta_state)
        self._ignore = ckpt_mod._ignore_list(model, meta_state)
        self._thread = threading.Thread(target=self._write, name="jgptq-checkpoint", daemon=True)
        self._thread.start()
        self.add(result.weights)

    def add(self, records: dict) -> None:
        """Records of a finished layer (checkpoint key -> :class:`jgptq.export.QuantizedWeight`), any thread."""
        for key, rec in records.items():
            if rec.codes.ndim != 2:
                raise ckpt_mod.ExportError(f"{key}: {type(self.model).__name__} checkpoints keep every expert in "
                                           f"one fused tensor {rec.shape}; the {self.kind} format holds 2-D "
                                           f"per-module weights only")
        if records:
            self._queue.put(dict(records))

    def finish(self, result) -> Path:
        """Called when every layer is done: gathers the unquantized tensors (kept layer tensors, layers a resumed
        run never loaded, the tensors outside the layers read from the checkpoint), lets the writer finish and
        put the folder in place. Returns its path."""
        try:
            for i in range(len(self.layers.layers)):
                if i not in self._kept:           # restored by a resumed run: read again, unquantized part only
                    self.layers.arrive(i, "cpu")
                    self.layers.leave(i)
            with self.layers.outside("cpu"):
                state = {}
                for name, t in self.model.state_dict().items():
                    layer = self._layer_of(name)
                    state[name] = self._kept[layer][name] if layer is not None and name in self._kept[layer] else t
                state = ckpt_mod.checkpoint_state(self.model, result, state=state)
                if list(state) != self._names:
                    raise ckpt_mod.ExportError(f"{self.out}: the unquantized tensors at the end "
                                               f"({len(state)}) are not those planned at the start "
                                               f"({len(self._names)})")
                self._queue.put((_END, state))
                self._thread.join()
        except BaseException:
            self.abort()
            raise
        finally:
            self.layers.on_leave = None
        if self._error is not None:
            raise self._error
        self.written = Path(self.out)
        return self.written

    def abort(self) -> None:
        """Stops the writer; the unfinished folder is removed (the output path stays as it was)."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put((_END, None))
            self._thread.join()
        self.layers.on_leave = None

    # -- the writer -------------------------------------------------------------------------------------------
    def _layer_of(self, name: str):
        prefix = self.layers.prefix + "."
        if not name.startswith(prefix):
            return None
        return int(name[len(prefix):].split(".", 1)[0])

    def _keep(self, i: int, layer) -> None:
        """Keeps the unquantized tensors of decoder layer ``i`` (called before the layer is released)."""
        base = f"{self.layers.prefix}.{i}."
        kept = {}
        for name, t in layer.state_dict().items():
            if base + name not in self._quantized:
                kept[base + name] = t.detach().to("cpu")
        self._kept[i] = kept

    def _entries(self):
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            self._waited += time.perf_counter() - t0
            if isinstance(item, tuple) and item[0] is _END:
                self._state = item[1]
                if self._state is None:
                    raise RuntimeError("the run stopped before its checkpoint folder was complete")
                return
            yield from item.items()

    def _tensors(self):
        for k, v in self._state.items():
            yield k, ckpt_mod._numpy(v)

    def _write(self) -> None:
        import shutil
        import tempfile

        scratch = Path(tempfile.mkdtemp(prefix="jgptq-export-"))
        started, self._waited = time.perf_counter(), 0.0
        try:
            extra = ckpt_mod._extra_files(self.model, self.tokenizer, self.source_dir, scratch)
            common = dict(tensors=self._tensors(), model_config=ckpt_mod.model_config_dict(self.model),
                          quant_config=self._result.config.quant, extra_files=extra,
                          max_shard_bytes=self.max_shard_bytes, overwrite=self.overwrite, **self.options)
            if self.kind == "gptq":
                export_gptq_v1(self.out, self._entries(), **common)
            else:
                export_compressed_tensors(self.out, self._entries(), ignore=self._ignore, **common)
        except BaseException as exc:  # noqa: BLE001 - raised by finish in the pipeline's thread
            self._error = exc
            while True:   # unblock a finish that waits (nothing more is read)
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            self.busy_s = time.perf_counter() - started - self._waited
