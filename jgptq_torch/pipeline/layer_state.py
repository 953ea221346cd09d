"""State a model's forward hands from one decoder layer to the next, carried by the run of one layer at a time.

Two kinds, both found from the model's own forward during the capture (:func:`jgptq_torch.pipeline.inputs.
capture_inputs`), none listed per model:

- values a layer returns beside its hidden states and the forward hands to the next layer's call (GLM-5's and
  Hunyuan V4's indexer top-k token indices). How many values a layer returns is read from its forward's return
  annotation (transformers annotates ``-> tuple[torch.Tensor, ...]``); the recorder's output unpacks into the hidden
  states and one placeholder per further value, and a placeholder met among the next layer's arguments becomes a
  :class:`Carried` link. Anything else done with a placeholder (computing on it) refuses the model;
- a container the forward hands to several layers and the layers write into and read from (transformers'
  ``KVSharingDict``: a layer reads the keys and values an earlier layer computed). A mapping of a type of its own
  (not a plain dict, which the capture copies per layer) given to more than one layer becomes a :class:`Shared`
  link, with its contents at the capture (empty).

:func:`run_layer` runs a decoder layer as the model's forward would: :func:`fill` gives the layer its arguments
with the links filled from the state its input hidden states carry (a fresh copy of each shared container, holding
what the stream's earlier layers wrote), and :func:`attach` gives the output hidden states the layer's further
values (attribute ``carried``: position in the output -> value) and the containers' contents after the layer
(attribute ``shared``: slot -> {key: value}). Each stream of hidden states (the run's replay, the float model's
stream, a calibration forward's outputs) thereby carries its own state; every forward of a decoder layer in the
pipeline goes through :func:`run_layer`. :func:`stored_state` / :func:`restore_state` keep it in a checkpoint's inputs file.
"""

from __future__ import annotations

import collections.abc
import copy
import inspect
import typing

import torch

from jgptq_torch import models

CARRIED = "carried"   # attribute of a layer's output hidden states: {position in the layer's output: value}
SHARED = "shared"     # attribute of a layer's output hidden states: {slot: contents of a shared container}


class Unpacked(Exception):
    pass


class Touched(Exception):
    pass


class Carried:
    """A link among a decoder layer's captured arguments: value ``index`` of the previous layer's output (index 0
    is the hidden states)."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"Carried({self.index})"


class Shared:
    """A link among captured arguments: the container ``slot`` the forward hands several layers; ``template`` is
    the container as captured (a copy of it, updated with a stream's contents, is what a layer is given)."""

    def __init__(self, slot: int, template):
        self.slot, self.template = slot, template

    def __repr__(self):
        return f"Shared({self.slot}, {type(self.template).__name__})"


class _Placeholder:
    """What the forward gets for value ``index`` of layer ``layer``'s output during the capture; anything done with
    it but handing it to a later layer stops the capture."""

    def __init__(self, layer: int, index: int):
        self.__dict__.update(layer=layer, index=index)

    def __getattr__(self, name):
        raise Touched

    def __bool__(self):
        raise Touched

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise Touched


def _touched(self, *args):
    raise Touched


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor", "lt", "le",
              "gt", "ge", "getitem", "len", "iter", "neg", "invert", "index", "int", "float"):
    setattr(_Placeholder, f"__{_name}__", _touched)


class LayerOutput(torch.Tensor):
    """What a recorder returns to the model's forward: the hidden states; unpacked (``hidden, state = layer(...)``)
    into them and one placeholder per further value of the layer's output (``arity``, set by the recorder), or
    refusing to be unpacked when the layer's annotation does not say how many values it returns."""

    def __iter__(self):
        arity, layer = self.__dict__.get("arity"), self.__dict__.get("layer")
        if not arity or arity < 2:
            raise Unpacked
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


def _map(obj, leaf):
    """``obj`` (nested tuples, lists and plain dicts) with ``leaf(x)`` in place of every other value x."""
    if isinstance(obj, tuple):
        return tuple(_map(o, leaf) for o in obj)
    if isinstance(obj, list):
        return [_map(o, leaf) for o in obj]
    if isinstance(obj, dict):
        return {k: _map(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def links(obj, i: int):
    """``obj`` (layer ``i``'s captured arguments) with each placeholder of layer ``i - 1``'s output replaced by its
    :class:`Carried` link; a placeholder of an earlier layer is refused (only the previous layer's output is
    carried)."""
    def leaf(x):
        if not isinstance(x, _Placeholder):
            return x
        if x.layer != i - 1:
            raise models.UnsupportedModelError(
                f"decoder layer {i} is given value {x.index} of layer {x.layer}'s output; jgptq carries state "
                f"from one layer to the next only")
        return Carried(x.index)
    return _map(obj, leaf)


def share(layer_args: list, moved) -> list:
    """One forward's captured arguments of every layer, with each container given to several layers (a mapping of
    a type of its own, the same object) replaced by a :class:`Shared` link; ``moved(x)``: a container's contents
    on the run's device."""
    seen: dict = {}
    for i, args in enumerate(layer_args):
        def leaf(x, i=i):
            if isinstance(x, collections.abc.MutableMapping) and type(x) is not dict:
                seen.setdefault(id(x), (x, set()))[1].add(i)
            return x
        _map(args, leaf)
    slots = {}
    for key, (container, users) in seen.items():
        if len(users) > 1:
            template = copy.copy(container)
            for k in list(template):
                template[k] = moved(template[k])
            slots[key] = Shared(len(slots), template)
    return [_map(args, lambda x: slots.get(id(x), x)) for args in layer_args]


def fill(layer, hs, args):
    """(the layer's arguments with their links filled from the state ``hs`` carries, {slot: container given}).

    Raises:
      RuntimeError: a :class:`Carried` link while ``hs`` carries no further values of a previous layer."""
    carried, shared = hs.__dict__.get(CARRIED), hs.__dict__.get(SHARED, {})
    given: dict = {}

    def leaf(x):
        if isinstance(x, Carried):
            if carried is None:
                raise RuntimeError(f"{type(layer).__name__}: takes state from the previous layer's output, which "
                                   f"these hidden states do not carry")
            return carried.get(x.index)
        if isinstance(x, Shared):
            if x.slot not in given:
                given[x.slot] = copy.copy(x.template)
                given[x.slot].update(shared.get(x.slot, {}))
            return given[x.slot]
        return x
    return _map(args, leaf), given


def attach(hidden, out, hs, given: dict):
    """``hidden`` (the layer's output hidden states) carrying the layer's further values (``out``: its output
    tuple) and the shared containers' contents: those the layer was given, as it left them, else its input's."""
    if isinstance(out, (tuple, list)) and len(out) > 1:
        hidden.__dict__[CARRIED] = {k: v for k, v in enumerate(out) if k}
    shared = dict(hs.__dict__.get(SHARED, {}))
    shared.update({slot: dict(c.items()) for slot, c in given.items()})
    if shared:
        hidden.__dict__[SHARED] = shared
    return hidden


def run_layer(layer, hs, rest, kwargs):
    """Runs ``layer`` on hidden states ``hs`` (B, S, H) and its captured arguments (``rest``, ``kwargs``:
    :func:`jgptq_torch.pipeline.inputs.capture_inputs`), their links filled from the state ``hs`` carries
    (:func:`fill`). Returns the output hidden states (B, S, H), carrying the state the layer hands on
    (:func:`attach`)."""
    (rest, kwargs), given = fill(layer, hs, (rest, kwargs))
    out = layer(hs, *rest, **kwargs)
    hidden = out[0] if isinstance(out, (tuple, list)) else out
    return attach(hidden, out, hs, given)


def stored_state(name: str, hidden) -> tuple:
    """The state ``hidden`` carries as tensors to store beside it: ({f"{name}~...": tensor on the CPU}, {name: the
    layout of the state, for :func:`restore_state`}). Refuses a value that is not a tensor, None or a tuple of
    tensors."""
    tensors, layout = {}, {}

    def put(key: str, v, what: str):
        if v is None:
            return None
        parts = v if isinstance(v, tuple) else (v,)
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise models.UnsupportedModelError(f"{what} is a {type(v).__name__}, which a checkpoint of the run "
                                               f"cannot store")
        for j, p in enumerate(parts):
            tensors[f"{key}~{j}"] = p.detach().to("cpu").contiguous()
        return len(parts) if isinstance(v, tuple) else -1

    carried, shared = hidden.__dict__.get(CARRIED), hidden.__dict__.get(SHARED)
    if carried is not None:
        layout["carried"] = {str(k): put(f"{name}~c{k}", v, f"value {k} a decoder layer returns beside its hidden "
                                         f"states") for k, v in carried.items()}
    if shared is not None:
        if not all(isinstance(k, str) for c in shared.values() for k in c):
            raise models.UnsupportedModelError("a container decoder layers share has keys other than strings, which "
                                               "a checkpoint of the run cannot store")
        layout["shared"] = {str(s): {str(k): put(f"{name}~s{s}~{k}", v, f"entry {k!r} of the container decoder "
                                                 f"layers share") for k, v in c.items()} for s, c in shared.items()}
    return tensors, ({name: layout} if layout else {})


def restore_state(hidden, name: str, stored: dict, layouts: dict, device):
    """``hidden`` with the state :func:`stored_state` stored under ``name`` attached again (on ``device``)."""
    layout = layouts.get(name)
    if not layout:
        return hidden

    def get(key: str, n):
        if n is None:
            return None
        parts = tuple(stored[f"{key}~{j}"].to(device) for j in range(max(n, 1)))
        return parts[0] if n == -1 else parts

    if "carried" in layout:
        hidden.__dict__[CARRIED] = {int(k): get(f"{name}~c{k}", n) for k, n in layout["carried"].items()}
    if "shared" in layout:
        hidden.__dict__[SHARED] = {int(s): {k: get(f"{name}~s{s}~{k}", n) for k, n in c.items()}
                                   for s, c in layout["shared"].items()}
    return hidden
