"""jgptq's imatrix statistic handed to llama.cpp the way a user would: a GGUF imatrix file with GGUF tensor names.

:func:`llama_imatrix` writes ``result.imatrix`` (model parameter name -> :class:`jgptq.imatrix.ImatrixEntry`) as a
GGUF imatrix file named by the model's GGUF tensors (a fused gate/up expert parameter feeds both
``ffn_gate_exps`` and ``ffn_up_exps``, which share their input), then reads it back as ``llama-quantize --imatrix``
does, giving the ``params.imatrix`` entries of ``llama_model_quantize``.
"""

from __future__ import annotations

from benchmarks.quality.llama_side import read_imatrix


def gguf_imatrix(model, imatrix: dict) -> dict:
    """{GGUF tensor name: ImatrixEntry} from {model parameter name: ImatrixEntry}."""
    from jgptq_torch.export.gguf.export import gguf_names

    names = gguf_names(model)
    out = {}
    for param, entry in imatrix.items():
        targets = names.get(param)
        if targets is None and param + ".weight" in names:
            targets = names[param + ".weight"]
        if not targets:
            raise ValueError(f"imatrix entry {param!r}: no GGUF tensor of the model takes this parameter")
        for gguf_name, _rows in targets:
            out[gguf_name] = entry
    return out


def write_gguf_imatrix(model, imatrix: dict, path: str) -> str:
    """Writes the statistic as a GGUF imatrix file with GGUF tensor names (the exporter's writer when it has one)."""
    try:
        from jgptq_torch.export.gguf.export import export_imatrix
    except ImportError:
        export_imatrix = None
    if export_imatrix is not None:
        return str(export_imatrix(model, imatrix, path, overwrite=True))
    from jgptq.imatrix import write_imatrix

    return write_imatrix(path, gguf_imatrix(model, imatrix), datasets=["pydoc_data.topics calibration split"],
                         overwrite=True)


def llama_imatrix(model, imatrix: dict, path: str) -> dict:
    """The ``params.imatrix`` entries llama.cpp's quantize tool would build from the statistic's GGUF file."""
    return read_imatrix(write_gguf_imatrix(model, imatrix, path))
