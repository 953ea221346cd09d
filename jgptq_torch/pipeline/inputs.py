"""The inputs of every decoder layer, recorded once: the model runs with its layers replaced by recorders.

:func:`capture_inputs` gives the first layer's hidden states per calibration batch and every layer's other
arguments (position embeddings, masks), moved to the run device; :func:`run_layer` runs a layer on them.
"""

from __future__ import annotations

import torch

from jgptq_torch import models


class _StopForward(Exception):
    pass


class _Unpacked(Exception):
    pass


class _LayerOutput(torch.Tensor):
    """What a recorder returns to the model's forward: the hidden states, refusing to be unpacked. A forward that
    unpacks a decoder layer's output (``hidden, state = layer(...)``) hands the next layer state that a run of one
    layer at a time does not carry."""

    def __iter__(self):
        raise _Unpacked


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
            if i and (type(hs) is not _LayerOutput or hs.shape != current["shape"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: decoder layer {i} is not given the hidden states layer {i - 1} "
                    f"returned; jgptq runs one layer at a time and carries only the hidden states between layers")
            current["layers"][i] = _to((rest, kwargs), device, current["memo"])
            if i == 0:
                current["hidden"] = hs.to(device)
            if i == len(layers) - 1:
                raise _StopForward
            current["shape"] = hs.shape
            return hs.as_subclass(_LayerOutput)
        return forward

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
            except _Unpacked:
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: its forward unpacks each decoder layer's output into several values "
                    f"(state handed from one layer to the next, such as routing or attention indices); jgptq runs "
                    f"one layer at a time and carries only the hidden states between layers") from None
            if current["hidden"] is None or any(r is None for r in current["layers"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: the forward did not call every decoder layer in order")
            hidden.append(current["hidden"])
            inputs.append(current["layers"])
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return hidden, inputs


def run_layer(layer, hs, rest, kwargs):
    out = layer(hs, *rest, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out
