"""The torch side of jgptq: transformers models in, quantized files out. ``import jgptq`` is the public face;
this package is what its torch-side names come from, and nothing in ``jgptq`` imports it otherwise.

Floors, each importing only those below it and ``jgptq``:

- :mod:`jgptq_torch.cli`: the ``jgptq`` command (``main``), ``jgptq demo`` and ``jgptq eval``;
- :mod:`jgptq_torch.export`: files that serving stacks load: compressed-tensors and GPTQ v1 folders
  (:mod:`~jgptq_torch.export.checkpoint`) and GGUF (:mod:`jgptq_torch.export.gguf`);
- :mod:`jgptq_torch.pipeline`: ``quantize_moe``, one decoder layer at a time (calibrate, solve, write back,
  replay) with the hooks around that step (offload, resume, the float stream, ``target_bpw``'s first pass);
- :mod:`jgptq_torch.source`: checkpoints read as plain float tensors, the quantized source formats (FP8 blocks,
  MXFP4, compressed-tensors) dequantized on read;
- the ground: :mod:`~jgptq_torch.models` (what a transformers model's structure is), :mod:`~jgptq_torch.report`
  (what a run produced), :mod:`~jgptq_torch.dlpack` (tensors between torch and JAX without copies),
  :mod:`~jgptq_torch.progress` and :mod:`~jgptq_torch.write_errors`.
"""
