"""The GGUF file of a streamed run (:func:`jgptq.quantize_folder`), written as its layers finish:
:class:`StreamedGGUFSink`.

The writer is :class:`jgptq_torch.export.gguf.stream.GGUFSink`'s: a thread puts each layer's tensors at their final
place in the file as soon as the layer's records exist. What a streamed model does not hold is read as
:class:`jgptq_torch.export.folder_sink.CheckpointSink` reads it:

- a decoder layer's unquantized tensors that the file holds (norms, routers, biases, a correction bias, gpt-oss's
  sinks, any weight left in float) are kept from the layer when it is released (``on_leave``) and dropped once
  written; the layers a resumed run restores are read from the checkpoint when the run starts, one at a time;
- the tensors outside the decoder layers (token embedding, final norm, output head) are read from the checkpoint
  when the run ends; the embedding and the head get llama.cpp's types for the run then (not encoded beside the
  layers, which would need them in memory for the whole run);
- each parameter's records leave host memory once its tensors are written (``releases_records``: the run's
  ``result.weights`` is empty at the end).

Host memory holds the layers the run holds (about two), the records and unquantized tensors of the layers not yet
written (a few MB a layer), and at the end the embedding and head. The file is the one
:func:`jgptq_torch.export.gguf.export.export_gguf` writes for the same run on the model loaded whole, byte for byte.

Example::

    result = jgptq.quantize_folder("Qwen3-30B-A3B", texts, "out/qwen3-30b-q4_k.gguf", export="gguf",
                                   format="q4_k", tokenizer=tok)
"""

from __future__ import annotations

import re

from jgptq_torch.export.gguf.stream import GGUFSink


class StreamedGGUFSink(GGUFSink):
    """Writes the GGUF file of a run streamed from its checkpoint folder (see the module).

    Args:
      out: the file (ending in ``.gguf``) or a folder that gets ``model.gguf``.
      layers: the run's :class:`jgptq_torch.source.stream.StreamedLayers` (the skeleton and its checkpoint).
      **options: as :class:`GGUFSink` (``overwrite``, ``tokenizer``, ``float_type``, ``file_type``, ``name``,
        ``float_embeddings``, ``verify``).
    """

    releases_records = True     # the pipeline drops each layer's records once handed here
    early_edges = False         # the embedding and head are read at the end only

    def __init__(self, out, layers, **options):
        super().__init__(out, **options)
        self.layers = layers
        self._values: dict = {}     # parameter -> host tensor of an unquantized tensor, until written
        self._kept: set = set()     # decoder layers whose unquantized tensors came
        self._under = re.compile(rf"^{re.escape(layers.prefix)}\.(\d+)\.")

    def start(self, model, result) -> None:
        """As :meth:`GGUFSink.start`; then reads the unquantized tensors of the layers a resumed run restored
        (their records came with ``result``), one layer at a time."""
        super().start(model, result)
        self._meta = dict(self._file.state)      # meta tensors: shapes for the checks, no storage
        self.layers.on_leave = self._keep
        for i in range(self._restored(result)):
            self.layers.arrive(i, "cpu")
            self.layers.leave(i)

    def finish(self, result):
        """Reads what is still missing (a layer never read, the tensors outside the layers) from the checkpoint,
        then finishes as :meth:`GGUFSink.finish`. Returns the file's path."""
        try:
            for i in range(len(self.layers.layers)):
                if i not in self._kept:          # a restored layer with no record: read for its float tensors
                    self.layers.arrive(i, "cpu")
                    self.layers.leave(i)
            with self.layers.outside("cpu"):
                state = self.model.state_dict()
                outside = {p: state[p] for p, e in self._file.plan.items() if e and self._layer_of(p) is None}
                with self._cond:
                    self._values.update(outside)
                    self._file.state.update(outside)   # what the embedding and head are encoded from
                    self._cond.notify_all()
                return super().finish(result)
        except BaseException:
            self.abort()
            raise
        finally:
            self.layers.on_leave = None
            self._values.clear()
            self._file.state.update(self._meta)

    def abort(self) -> None:
        super().abort()
        self.layers.on_leave = None

    # -- where the float tensors come from ----------------------------------------------------------------------
    @property
    def model(self):
        return self._file.model

    def _layer_of(self, name: str):
        m = self._under.match(name)
        return int(m.group(1)) if m else None

    def _restored(self, result) -> int:
        """How many leading layers ``result`` already holds every record of (restored by a resumed run)."""
        have = set(result.weights)
        by_layer: dict = {}
        for param, keys in self._keys.items():
            layer = self._layer_of(param)
            if layer is not None:
                by_layer[layer] = by_layer.get(layer, True) and all(k in have for k in keys)
        done = 0
        while by_layer.get(done, False):
            done += 1
        return done

    def _keep(self, i: int, layer) -> None:
        """Keeps the unquantized tensors of decoder layer ``i`` that the file holds (before it is released)."""
        base = f"{self.layers.prefix}.{i}."
        kept = {}
        for name, t in layer.state_dict().items():
            param = base + name
            if param not in self._keys and self._file.plan.get(param):
                kept[param] = t.detach().to("cpu")
        with self._cond:
            self._values.update(kept)
            self._kept.add(i)
            self._cond.notify_all()

    def _ready(self, param: str) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or param in self._values)
            if self._error is None:
                self._file.state[param] = self._values[param]

    def _written(self, param: str) -> None:
        super()._written(param)
        if not self._left[param] and param in self._values:
            with self._cond:
                del self._values[param]
                self._file.state[param] = self._meta[param]
