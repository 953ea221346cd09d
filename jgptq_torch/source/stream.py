"""A layerwise run whose decoder layers come from a checkpoint folder: :func:`quantize_folder`.

Usage::

    import jgptq

    result = jgptq.quantize_folder("Qwen3-235B-A22B", texts, "out/qwen3-235b-w4g128", bits=4, group_size=128,
                                   scale_dtype="bfloat16", device="cuda", checkpoint_dir="out/state")

The model never exists whole in memory. Its skeleton is built on the meta device
(:meth:`jgptq_torch.source.checkpoint.CheckpointSource.skeleton`); the run's layer placement
(:class:`jgptq_torch.pipeline.offload.Placement`, mode ``"stream"``, the sibling of ``offload="disk"``) reads each
decoder layer from the checkpoint when its turn comes (:meth:`StreamedLayers.arrive`, onto the run device) and
releases it to meta once processed (:meth:`StreamedLayers.leave`). The input embedding is read for the capture of
the first layer's inputs and released after it; the final norm and the head are never read unless an export
needs them. The per-layer step is :func:`jgptq_torch.pipeline.layerwise.quantize_moe`'s, unchanged.

With an output, the export is written as the layers finish (:class:`jgptq_torch.export.folder_sink.
CheckpointSink` for a ``compressed-tensors`` or ``gptq`` folder, :class:`jgptq_torch.export.gguf.folder_sink.
StreamedGGUFSink` for a ``gguf`` file), and each layer's records leave host memory once written.
"""

from __future__ import annotations

import contextlib

import torch

from jgptq_torch.pipeline.layer_files import release_layer
from jgptq_torch.source.checkpoint import CheckpointSource, release_outside


class StreamedLayers:
    """The decoder layers of a :class:`CheckpointSource`'s skeleton, read and released one at a time.

    Args:
      source: the checkpoint (its :meth:`~CheckpointSource.skeleton` built).
    """

    def __init__(self, source: CheckpointSource):
        from jgptq_torch import models

        self.source = source
        self.model = source.model
        self.prefix, self.layers = models.find_decoder_layers(self.model)
        self.on_leave = None      # called as on_leave(i, layer) before a layer is released (an export keeps parts)

    def memory(self) -> dict:
        """``bytes_read`` from the checkpoint and ``peak_parameters``: the most bytes of the model's tensors
        (parameters and buffers, any device) materialized at once, counted after every read."""
        return {"bytes_read": self.source.bytes_read, "peak_parameters": self.source.peak_parameters}

    def arrive(self, i: int, device) -> None:
        """Reads decoder layer ``i``'s tensors from the checkpoint onto ``device`` (transformers' conversions
        applied). Raises :class:`jgptq_torch.source.checkpoint.SourceError` for a layer the checkpoint lacks.

        On CUDA the blocks torch cached while reading go back to the device: the stored tensors, their
        dequantization and transformers' per-expert pieces before they are fused take about as much again as the
        layer, and held in torch's cache they would be out of reach of the layer's Hessians and solves."""
        self.source.load(f"decoder layer {i} ({self.prefix}.{i})", i, device)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()

    def leave(self, i: int) -> None:
        """Releases decoder layer ``i`` to the meta device (after :attr:`on_leave`, when set)."""
        if self.on_leave is not None:
            self.on_leave(i, self.layers[i])
        release_layer(self.layers[i])

    @contextlib.contextmanager
    def embedding(self, device):
        """The input embedding, loaded onto ``device`` while the block runs (the capture of the first layer's
        inputs), released after it."""
        self.source.load("the input embedding", "embedding", device)
        try:
            yield
        finally:
            release_outside(self.model, self.layers)

    @contextlib.contextmanager
    def outside(self, device="cpu"):
        """Every tensor outside the decoder layers (embeddings, final norm, head), loaded onto ``device`` while the
        block runs (an export's unquantized tensors), released after it."""
        self.source.load("the input embedding", "embedding", device)
        self.source.load("the tensors outside the decoder layers", "outside", device)
        self.model.tie_weights()      # a tied head shares the embedding just read, as from_pretrained ties it
        try:
            yield
        finally:
            release_outside(self.model, self.layers)


def open_folder(model_dir, dtype=None, device="cpu", trust_remote_code: bool = False):
    """(model skeleton on meta, :class:`StreamedLayers`) of the checkpoint folder ``model_dir``; the skeleton's
    non-persistent buffers (rotary frequencies) are placed on ``device``."""
    source = CheckpointSource(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
    model = source.skeleton()
    for module in model.modules():
        for b, t in module._buffers.items():
            if t is not None and t.device.type != "meta":
                module._buffers[b] = t.to(device)
    return model, StreamedLayers(source)


def quantize_folder(model_dir, calib, out_dir=None, config=None, *, export: str = "compressed-tensors",
                    tokenizer=None, device=None, dtype=None, checkpoint_dir=None, resume: bool = True,
                    overwrite: bool = False, trust_remote_code: bool = False, max_shard_bytes=None,
                    export_options=None, **kwargs):
    """Quantizes the model in the checkpoint folder ``model_dir`` layer by layer, reading each decoder layer from
    disk when its turn comes, and writes ``out_dir`` as the layers finish.

    Args:
      model_dir: a transformers model folder (``config.json``, safetensors shards with
        ``model.safetensors.index.json`` or one ``model.safetensors``).
      calib: calibration data (:mod:`jgptq_torch.pipeline.calib`: token ids, or text with ``tokenizer``).
      out_dir: the output folder (or GGUF file); None: nothing is written, the records stay in ``result.weights``.
      config: a :class:`jgptq.config.PipelineConfig` / :class:`jgptq.config.QuantConfig` or None; ``**kwargs``
        override its fields as for :func:`jgptq.quantize_moe`.
      export: ``"compressed-tensors"``, ``"gptq"`` or ``"gguf"`` (a GGML format's file; ``out_dir`` ending in
        ``.gguf`` names the file, else it is ``out_dir/model.gguf``).
      tokenizer: a transformers tokenizer (text calibration; its files go to the output).
      device: the torch device layers run on (default: ``"cuda"`` when there is one, else ``"cpu"``).
      dtype: the dtype floating weights load in (a torch dtype; default: the config's).
      checkpoint_dir, resume: a resumable run (:func:`jgptq.quantize_moe`); a restarted run continues after its
        last finished layer and writes the same bytes.
      overwrite: replace an existing output.
      max_shard_bytes: most tensor bytes per output shard (default: the exporters'; not for ``gguf``).
      export_options: passed to the sink (``gguf``: ``float_embeddings``, ``float_type``, ``name``, ...; see
        :class:`jgptq_torch.export.gguf.stream.GGUFSink`).
    Returns:
      The :class:`jgptq.QuantizeResult`; ``result.model`` is the skeleton (decoder layers on meta). With an
      ``out_dir``, ``result.weights`` is empty (written and released layer by layer).
    """
    from jgptq_torch.pipeline.layerwise import quantize_moe

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, layers = open_folder(model_dir, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    sink = None
    if out_dir is not None:
        sink = make_sink(export, out_dir, model_dir, layers, tokenizer=tokenizer, overwrite=overwrite,
                         max_shard_bytes=max_shard_bytes, **(export_options or {}))
    return quantize_moe(model, calib, config, tokenizer=tokenizer, device=device, checkpoint_dir=checkpoint_dir,
                        resume=resume, sink=sink, source=layers, **kwargs)


def make_sink(export: str, out_dir, model_dir, layers: StreamedLayers, *, tokenizer=None, overwrite=False,
              max_shard_bytes=None, **options):
    """The sink that writes ``export`` to ``out_dir`` as the layers of a streamed run finish. A ``gguf`` export
    of a model or tokenizer the GGUF exporter refuses is refused here, before any layer is read
    (:func:`jgptq_torch.export.gguf.export.check_exportable`)."""
    from jgptq_torch.export.folder_sink import CheckpointSink

    if export == "gguf":
        from jgptq_torch.export.gguf.export import check_exportable
        from jgptq_torch.export.gguf.folder_sink import StreamedGGUFSink

        if max_shard_bytes is not None:
            raise ValueError("max_shard_bytes is for checkpoint folders; a GGUF export is one file")
        check_exportable(layers.model, tokenizer)
        return StreamedGGUFSink(out_dir, layers, tokenizer=tokenizer, overwrite=overwrite, **options)

    return CheckpointSink(export, out_dir, layers, source_dir=model_dir, tokenizer=tokenizer, overwrite=overwrite,
                          max_shard_bytes=max_shard_bytes, **options)
