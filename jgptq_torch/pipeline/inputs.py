"""The inputs of every decoder layer, recorded once: the model runs with its layers replaced by recorders.

:func:`capture_inputs` gives the first layer's hidden states per calibration batch and every layer's other
arguments (position embeddings, masks), moved to the run device; :func:`run_layer` runs a layer on them.

State handed from one layer to the next. A decoder layer may return more than its hidden states (GLM-5's
returns its attention indexer's top-k token indices) and the model's forward hand some of those values to the
next layer's call. How many values a layer returns is read from its forward's return annotation (transformers
annotates ``-> tuple[torch.Tensor, ...]``); during the capture a recorder hands the forward its hidden states
followed by one placeholder per further value, and a placeholder met among the next layer's arguments is kept
there as a :class:`Carried` link. :func:`run_layer` then returns the layer's hidden states with the further values
attached (``carried``, their position in the output -> value), and fills the links of the next layer's arguments
from the hidden states it is given: each stream of hidden states (the run's replay, the float model's stream)
carries its own state, as the model's forward would.
"""

from __future__ import annotations

import inspect
import typing

import torch

from jgptq_torch import models

CARRIED = "carried"   # attribute of a layer's output hidden states: {position in the layer's output: value}


class _StopForward(Exception):
    pass


class _Unpacked(Exception):
    pass


class _Touched(Exception):
    pass


class Carried:
    """A link among a decoder layer's captured arguments: value ``index`` of the previous layer's output (index 0
    is the hidden states)."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Carried({self.index})"


class _Placeholder:
    """What the forward gets for value ``index`` of layer ``layer``'s output during the capture; anything done with
    it but handing it to a later layer stops the capture."""

    def __init__(self, layer: int, index: int):
        self.__dict__.update(layer=layer, index=index)

    def __getattr__(self, name):
        raise _Touched

    def __bool__(self):
        raise _Touched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _Touched


def _touched(self, *args):
    raise _Touched


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lt", "le",
              "gt", "ge", "getitem", "len", "iter", "neg", "invert", "index", "int", "float"):
    setattr(_Placeholder, f"__{_name}__", _touched)


class _LayerOutput(torch.Tensor):
    """What a recorder returns to the model's forward: the hidden states; unpacked (``hidden, state = layer(...)``)
    into them and one placeholder per further value of the layer's output (``arity``, set by the recorder), or
    refusing to be unpacked when the layer's annotation does not say how many values it returns."""

    def __iter__(self):
        arity, layer = self.__dict__.get("arity"), self.__dict__.get("layer")
        if not arity or arity < 2:
            raise _Unpacked
        yield self
        for k in range(1, arity):
            yield _Placeholder(layer, k)


def output_arity(layer) -> int:
    """How many values ``layer``'s forward returns, from its return annotation: n for ``tuple[A, B, ...]`` of n
    types, 0 when it says no tuple of a fixed length (or nothing)."""
    fn = inspect.unwrap(type(layer).forward)
    try:
        ann = typing.get_type_hints(fn).get("return")
    except (NameError, TypeError):   # an annotation that does not resolve: its unresolved form
        ann = inspect.signature(fn).return_annotation
    if typing.get_origin(ann) is not tuple:
        return 0
    args = typing.get_args(ann)
    return 0 if Ellipsis in args else len(args)


def _links(obj, i: int):
    """``obj`` (a layer's captured arguments) with each placeholder of layer ``i - 1``'s output replaced by its
    :class:`Carried` link; a placeholder of an earlier layer is refused (only the previous layer's output is
    carried)."""
    if isinstance(obj, _Placeholder):
        if obj.layer != i - 1:
            raise models.UnsupportedModelError(
                f"decoder layer {i} is given value {obj.index} of layer {obj.layer}'s output; jgptq carries state "
                f"from one layer to the next only")
        return Carried(obj.index)
    if isinstance(obj, tuple):
        return tuple(_links(o, i) for o in obj)
    if isinstance(obj, list):
        return [_links(o, i) for o in obj]
    if isinstance(obj, dict):
        return {k: _links(v, i) for k, v in obj.items()}
    return obj


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
            current["layers"][i] = _to(_links((rest, kwargs), i), device, current["memo"])
            if i == 0:
                current["hidden"] = hs.to(device)
            if i == len(layers) - 1:
                raise _StopForward
            current["shape"] = hs.shape
            out = hs.as_subclass(_LayerOutput)
            out.__dict__.update(arity=arities[i], layer=i)
            return out
        return forward

    arities = [output_arity(layer) for layer in layers]
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
                    f"(state handed from one layer to the next) and its decoder layer's forward does not say how "
                    f"many (a return annotation tuple[...] of a fixed length); jgptq cannot carry that state") from None
            except _Touched:
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: its forward computes on a value a decoder layer returned beside the "
                    f"hidden states before handing it on; jgptq carries such state only as the layer returned it"
                ) from None
            if current["hidden"] is None or any(r is None for r in current["layers"]):
                raise models.UnsupportedModelError(
                    f"{type(model).__name__}: the forward did not call every decoder layer in order")
            hidden.append(current["hidden"])
            inputs.append(current["layers"])
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
    return hidden, inputs


def _fill(obj, carried: dict):
    if isinstance(obj, Carried):
        return carried.get(obj.index)
    if isinstance(obj, tuple):
        return tuple(_fill(o, carried) for o in obj)
    if isinstance(obj, list):
        return [_fill(o, carried) for o in obj]
    if isinstance(obj, dict):
        return {k: _fill(v, carried) for k, v in obj.items()}
    return obj


def _has_links(obj) -> bool:
    if isinstance(obj, Carried):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_links(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_links(v) for v in obj.values())
    return False


def run_layer(layer, hs, rest, kwargs):
    """Runs ``layer`` on hidden states ``hs`` (B, S, H) and its captured arguments, their :class:`Carried` links
    filled from the state ``hs`` carries (the previous layer's further outputs). Returns the output hidden
    states; a layer returning further values gets them attached as ``carried`` (position -> value)."""
    if _has_links((rest, kwargs)):
        carried = hs.__dict__.get(CARRIED)
        if carried is None:
            raise RuntimeError(f"{type(layer).__name__}: takes state from the previous layer's output, which these "
                               f"hidden states do not carry")
        rest, kwargs = _fill((rest, kwargs), carried)
    out = layer(hs, *rest, **kwargs)
    if not isinstance(out, (tuple, list)):
        return out
    hidden = out[0]
    if len(out) > 1:
        hidden.__dict__[CARRIED] = dict(enumerate(out))
        del hidden.__dict__[CARRIED][0]
    return hidden


def carried_tensors(name: str, hidden) -> tuple:
    """The state a stream's hidden states carry, as tensors to store beside them: ({f"{name}~{position}": value on
    the CPU}, {name: [positions]}) (a value of None is a position without a tensor). Refuses a value that is
    neither a tensor nor None."""
    carried = hidden.__dict__.get(CARRIED)
    if carried is None:
        return {}, {}
    tensors = {}
    for k, v in carried.items():
        if v is None:
            continue
        if not isinstance(v, torch.Tensor):
            raise models.UnsupportedModelError(f"value {k} a decoder layer returns beside its hidden states is a "
                                               f"{type(v).__name__}, which a checkpoint of the run cannot store")
        tensors[f"{name}~{k}"] = v.detach().to("cpu").contiguous()
    return tensors, {name: sorted(carried)}


def restore_carried(hidden, name: str, stored: dict, positions: dict, device):
    """``hidden`` with the state stored by :func:`carried_tensors` under ``name`` attached again (on ``device``)."""
    if name in positions:
        hidden.__dict__[CARRIED] = {k: (stored[f"{name}~{k}"].to(device) if f"{name}~{k}" in stored else None)
                                    for k in positions[name]}
    return hidden
