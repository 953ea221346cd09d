"""jgptq: GPTQ for Mixture-of-Experts language models, with every numerical step as jitted JAX.

``import jgptq`` is the whole public face, and it never imports torch: each name below is imported on first use.

- :func:`quantize_moe` quantizes a Hugging Face transformers model layer by layer (torch side); it returns a
  :class:`QuantizeResult` (its :class:`Report` says what happened to every matrix);
- :func:`quantize_folder` does the same for a model folder that is never loaded whole: each decoder layer is read
  from the checkpoint when its turn comes and the output (:class:`CheckpointSink`, or a GGUF file) is written as
  the layers finish;
- :func:`export_model` writes that result as a checkpoint (compressed-tensors, GPTQ v1 or GGUF);
  :func:`export_gguf` also writes a float model, :func:`check_exportable` refuses up front what the GGUF writer
  would refuse, :func:`export_imatrix` writes a run's importance statistic for ``llama-quantize --imatrix``;
  :class:`GGUFSink` (``quantize_moe(..., sink=...)``) writes the GGUF file layer by layer while the run goes;
- :func:`evaluate` compares a quantized checkpoint (a jgptq output folder or a GGUF file) with its float model on
  held-out text as llama-perplexity does (KL, top-1 agreement, perplexities); it returns an :class:`Evaluation`;
- :func:`load_layer` and :func:`reload_all` load the layers a run with ``offload="disk", reload=False`` left in
  its layer files;
- :class:`QuantConfig`, :class:`MoEConfig`, :class:`PipelineConfig`: the configuration;
- the errors a run raises on bad input, all subclasses of ``ValueError``: :class:`UnsupportedModelError` (a model
  layout jgptq cannot see into), :class:`ResumeMismatchError` (a resume state of another run),
  :class:`DeviceBudgetError` (a layer over ``device_budget``), :class:`ExportError` (a result the export format
  cannot hold), :class:`UnsupportedGGUFModel` (a model family or setting the GGUF writer does not support),
  :class:`EvaluationError` (bad input to :func:`evaluate`).

The pure JAX functions live in the submodules: :mod:`jgptq.hessian`, :mod:`jgptq.gptq`,
:mod:`jgptq.quantizers`, :mod:`jgptq.ggml`, :mod:`jgptq.parallel`, :mod:`jgptq.flax`, :mod:`jgptq.export`; the
``jgptq`` command line is :mod:`jgptq_torch.cli.main`. Without torch, a torch-side name raises
:class:`NeedsTorchError` (an ``AttributeError`` that says what to install). Importing jgptq changes no setting of
the process; the torch side's entry points ask JAX not to preallocate the GPU (:mod:`jgptq_torch.gpu_sharing`).
"""

from jgptq.version import __version__


# public name -> the module that defines it (imported on first access)
_PUBLIC = {
    "quantize_moe": "jgptq_torch.pipeline.layerwise",
    "quantize_folder": "jgptq_torch.source.stream",
    "CheckpointSink": "jgptq_torch.export.folder_sink",
    "export_model": "jgptq_torch.export.checkpoint",
    "export_gguf": "jgptq_torch.export.gguf.export",
    "export_imatrix": "jgptq_torch.export.gguf.export",
    "check_exportable": "jgptq_torch.export.gguf.export",
    "GGUFSink": "jgptq_torch.export.gguf.stream",
    "evaluate": "jgptq_torch.cli.evaluate",
    "Evaluation": "jgptq.evaluation",
    "EvaluationError": "jgptq.evaluation",
    "load_layer": "jgptq_torch.pipeline.layer_files",
    "reload_all": "jgptq_torch.pipeline.layer_files",
    "QuantizeResult": "jgptq_torch.report",
    "Report": "jgptq_torch.report",
    "QuantConfig": "jgptq.config",
    "MoEConfig": "jgptq.config",
    "PipelineConfig": "jgptq.config",
    "UnsupportedModelError": "jgptq_torch.models",
    "ResumeMismatchError": "jgptq_torch.pipeline.resume",
    "DeviceBudgetError": "jgptq_torch.pipeline.offload",
    "ExportError": "jgptq_torch.export.checkpoint",
    "UnsupportedGGUFModel": "jgptq_torch.export.gguf.arch",
}
_TORCH_SIDE = ("torch", "transformers", "tokenizers")


class NeedsTorchError(AttributeError):
    """A torch-side name of the face asked for where torch (or transformers) cannot be imported. An
    ``AttributeError``, so that ``help(jgptq)``, ``hasattr`` and ``inspect`` pass over the name; its message says
    what to install, and ``__cause__`` is the ``ModuleNotFoundError`` (its ``name`` the missing package)."""
__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    """Imports the module behind a public name on first access (so ``import jgptq`` stays torch-free)."""
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'jgptq' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in _TORCH_SIDE:
            raise NeedsTorchError(f"jgptq.{name} runs transformers models and needs {exc.name}; install them "
                                  f"with: pip install 'jgptq[torch]'", name=name) from exc
        raise
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_PUBLIC))
