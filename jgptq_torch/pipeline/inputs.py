"""The inputs of every decoder layer, recorded once: the model runs with its layers replaced by recorders.

:func:`capture_inputs` gives the first layer's hidden states per calibration batch and every layer's other
arguments (position embeddings, masks), moved to the run device.

State a model's forward hands from one layer to the next (a layer's further outputs, a container several layers
share) is found during the capture as links among those arguments; each stream of hidden states carries its own,
and :func:`jgptq_torch.pipeline.layer_state.run_layer` runs a layer on the arguments with the links filled.
"""

from __future__ import annotations

import torch

from jgptq_torch import models
from jgptq_torch.pipeline import layer_state as state


class _StopForward(Exception):
    pass


def _param_device(module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def _to(obj, device, memo: dict):
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = obj.to(device).as_subclass(torch.Tensor)
        return memo[key]
    if isinstance(obj, tuple):
        return tuple(_to(o, device, memo) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device, memo) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device, memo) for k, v in obj.items()}
    return obj


def capture_inputs(model, layers, batch_list, device):
    """Runs the model once per batch with every decoder layer replaced by a recorder.

    Returns:
      (hidden, layer_inputs): hidden[b] = first-layer input (B, S, H) of batch b on ``device``;
      layer_inputs[b][i] = (positional args after hidden_states, keyword args) of layer i for batch b.
    """
    hidden, inputs = [], []
    current: dict = {}

    def recorder(i):
        def forward(*args, **kwargs):
            if args:
                hs, rest = args[0], args[1:]
            else:
                hs, rest = kwargs.pop("hidden_states"), ()
            if i and (type(hs) is not state.LayerOutput or hs.shape != current["shape"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: decoder layer {i} is not given the hidden states layer {i - 1} "
                    f"returned; jgptq runs one layer at a time and carries only the hidden states between layers")
            current["layers"][i] = state.links((rest, kwargs), i)
            if i == 0:
                current["hidden"] = hs.to(device)
            if i == len(layers) - 1:
                raise _StopForward
            current["shape"] = hs.shape
            out = hs.as_subclass(state.LayerOutput)
            out.__dict__.update(arity=arities[i], layer=i)
            return out
        return forward

    arities = [state.output_arity(layer) for layer in layers]
    for i, layer in enumerate(layers):
        layer.forward = recorder(i)
    emb = model.get_input_embeddings()
    emb_device = emb.weight.device if emb is not None else _param_device(model)
    try:
        for b in batch_list:
            current.update(layers=[None] * len(layers), memo={}, hidden=None)
            try:
                model(input_ids=b.input_ids.to(emb_device), attention_mask=b.attention_mask.to(emb_device),
                      use_cache=False)
            except _StopForward:
                pass
            except state.Unpacked:
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: its forward unpacks each decoder layer's output into several values "
                    f"(state handed from one layer to the next) and its decoder layer's forward does not say how "
                    f"many (a return annotation tuple[...] of a fixed length); jgptq cannot carry that state") from None
            except state.Touched:
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: its forward computes on a value a decoder layer returned beside the "
                    f"hidden states before handing it on; jgptq carries such state only as the layer returned it"
                ) from None
            if current["hidden"] is None or any(r is None for r in current["layers"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: the forward did not call every decoder layer in order")
            memo = current["memo"]
            shared = state.share(current["layers"], lambda x, memo=memo: _to(x, device, memo))
            hidden.append(current["hidden"])
            inputs.append([_to(args, device, memo) for args in shared])
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return hidden, inputs
