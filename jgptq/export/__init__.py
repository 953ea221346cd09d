"""Checkpoint writers for integer-grid GPTQ results (numpy and safetensors only; no torch).

- :class:`QuantizedWeight` (:mod:`.records`): codes, scales, zero points and ``g_idx`` of one weight or a stack;
  :func:`expert_entries` names a fused expert stack per expert.
- :func:`export_gptq_v1` (:mod:`.gptq_v1`): the GPTQ layout GPTQModel and vLLM load (transformers: dense models).
- :func:`export_compressed_tensors` (:mod:`.compressed_tensors`): compressed-tensors ``pack-quantized`` (vLLM).
- :func:`write_checkpoint` (:mod:`.shards`): atomic sharded safetensors folders with an index.
- :func:`pack_int32` / :func:`unpack_int32` (:mod:`.packing`): dense little-endian int32 bit packing, 1..8 bits.
- :func:`write_gguf` / :class:`GGUFTensor` (:mod:`.gguf`): GGUF files of float tensors and GGML block payloads
  (:class:`GGMLWeight`), written atomically.

Example (one dense model, every Linear quantized with the same config)::

    from jgptq.export import QuantizedWeight, export_gptq_v1

    quantized = {name: QuantizedWeight.from_result(res, config) for name, res in results.items()}
    export_gptq_v1("out", quantized, tensors=other_tensors, model_config=model.config.to_dict(),
                   quant_config=config)
"""

from jgptq.export.compressed_tensors import export_compressed_tensors
from jgptq.export.gguf import GGUFTensor, write_gguf
from jgptq.export.gptq_v1 import export_gptq_v1
from jgptq.export.packing import pack_int32, packed_length, unpack_int32
from jgptq.export.records import GGMLWeight, QuantizedWeight, expert_entries
from jgptq.export.shards import write_checkpoint

__all__ = ["QuantizedWeight", "GGMLWeight", "expert_entries", "export_gptq_v1", "export_compressed_tensors", "write_checkpoint",
           "pack_int32", "unpack_int32", "packed_length", "GGUFTensor", "write_gguf"]
