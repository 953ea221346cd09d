"""What jgptq needs to know about a transformers model's structure, read from the model itself where possible.

- :func:`find_decoder_layers`: the list of decoder layers (the ``ModuleList`` whose members are the classes the
  model names in ``_no_split_modules``).
- :func:`layer_targets`: the weights of one decoder layer to quantize: ``nn.Linear`` modules, fused experts
  modules (those decorated with transformers' ``use_experts_implementation``, which describe their own layout with
  the ``is_transposed`` / ``is_concatenated`` / ``has_gate`` / ``has_bias`` flags) and experts stacks that are
  modules of their own (:data:`STACKED_EXPERTS`), experts kept as blocks of rows of 2-D parameters
  (:mod:`jgptq_torch.row_experts`). Routers, embeddings and the output head are never targets.
- :class:`ExpertsLayout`: the nn.Linear-orientation (out, in) view of every expert's fused weights;
  :class:`StackLayout`: the same for a single stack.
- :func:`checkpoint_names` (:mod:`jgptq_torch.checkpoint_keys`): where each row of a target lands in a checkpoint
  (fused experts are split into per-expert names by transformers' own reverse weight conversion).

The only per-architecture facts kept here are for models that do not describe themselves.
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

from jgptq_torch.matrix import Matrix, UnsupportedModelError  # noqa: F401  (their home before)
from jgptq_torch.row_experts import RowsLayout, is_row_experts


# Relative names (inside a decoder layer) of linear modules that route rather than transform: quantizing them
# changes which experts run. ``mlp.gate`` routers are plain parameters in transformers 5, listed for older layouts.
ROUTER_PATTERNS = (r"(^|\.)gate$", r"(^|\.)router$", r"(^|\.)shared_expert_gate$", r"(^|\.)router_gate$",
                   r"(^|\.)gate\.wg$",    # HunYuan's router: a Linear ``wg`` inside its gate module
                   r"(^|\.)router\.layer$")   # JetMoe's: a Linear ``layer`` inside its router module

# Undispatched experts whose inputs jgptq reads (``pipeline.prescaled_capture``): layout flags and their router's
# attribute in the parent. Llama 4: every token reaches every expert pre-scaled by its routing score (0 off top-k).
PRESCALED_EXPERTS = {"Llama4TextExperts": {"flags": {"is_transposed": True}, "router": "router"}}

# Stacks of E matrices, a module each, given rows sorted by expert and the rows per expert (read by
# ``pipeline.stacked_capture``; JetMoe's MLP and attention experts): the parent's router attribute, and where its
# output tuple holds each sorted row's token, its routing weight and the rows per expert.
STACKED_EXPERTS = {"JetMoeParallelExperts": {"router": "router", "tokens": 1, "weights": 2, "sizes": 3}}

# Flags set by ``use_experts_implementation`` and their values when an older transformers does not set them.
FLAG_DEFAULTS = {"is_transposed": False, "is_concatenated": True, "has_gate": True, "has_bias": False,
                 "has_post_expert_norm": False}


def flag(module, name: str) -> bool:
    """An experts module's layout flag (for a class of :data:`PRESCALED_EXPERTS`, the flag listed there; its default
    when the installed transformers does not set it)."""
    listed = PRESCALED_EXPERTS.get(type(module).__name__, {}).get("flags", {})
    return bool(getattr(module, name, listed.get(name, FLAG_DEFAULTS[name])))


def is_stacked(module: nn.Module) -> bool:
    """True for an experts stack of :data:`STACKED_EXPERTS` (one 3-D ``weight``, its forward given sorted rows)."""
    return type(module).__name__ in STACKED_EXPERTS


def is_prescaled(module: nn.Module) -> bool:
    """True for an experts module of :data:`PRESCALED_EXPERTS` (inputs pre-scaled by routing scores, read by
    ``jgptq_torch.pipeline.prescaled_capture`` rather than through transformers' experts interface)."""
    return type(module).__name__ in PRESCALED_EXPERTS


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers of ``model``: (qualified name of the ModuleList, the list).

    The list is the longest ModuleList whose members are all of the model's ``_no_split_modules`` classes (hybrid
    models mix several: attention and Mamba layers, sliding and full ones), else the longest list of one repeated
    class.

    Raises:
      UnsupportedModelError: no ModuleList of the model's ``_no_split_modules`` classes (or of one repeated
        class) was found.
    """
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    best = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(m).__name__ for m in module}
        named = kinds <= wanted
        if len(kinds) != 1 and not named:
            continue
        score = (named, len(module))
        if best is None or score > best[0]:
            best = (score, name, module)
    if best is None or (wanted and not best[0][0] and best[0][1] < 2):
        raise UnsupportedModelError(f"{type(model).__name__}: no list of decoder layers found "
                                    f"(looked for a ModuleList of {sorted(wanted) or 'one repeated class'})")
    return best[1], best[2]


def is_experts_module(module: nn.Module) -> bool:
    """True for a fused-experts module decorated with transformers' ``use_experts_implementation``, or of a class of
    :data:`PRESCALED_EXPERTS`."""
    down = getattr(module, "down_proj", None)
    return (isinstance(down, nn.Parameter) and down.ndim == 3 and hasattr(module, "num_experts")
            and (hasattr(module, "has_gate") or hasattr(module, "is_transposed") or is_prescaled(module)))


@dataclasses.dataclass(frozen=True)
class ExpertsLayout:
    """How one fused-experts module stores its weights (read from its flags).

    Attributes:
      up_name: ``"gate_up_proj"`` (gated) or ``"up_proj"``.
      transposed: weights stored (E, in, out) instead of nn.Linear's (E, out, in).
      concatenated: gate/up rows stored as [gate; up] halves (False: interleaved g0, u0, g1, u1, ...).
      gated, biased, post_norm: the remaining flags.
      num_experts, hidden, inter: E, the hidden size and the expert width.
    """

    up_name: str
    transposed: bool
    concatenated: bool
    gated: bool
    biased: bool
    post_norm: bool
    num_experts: int
    hidden: int
    inter: int

    @classmethod
    def of(cls, module: nn.Module) -> "ExpertsLayout":
        gated = flag(module, "has_gate")
        up_name = "gate_up_proj" if gated else "up_proj"
        up = getattr(module, up_name, None)
        if not isinstance(up, nn.Parameter) or up.ndim != 3:
            raise UnsupportedModelError(f"{type(module).__name__}: expected a 3-D parameter {up_name!r}")
        e, a, b = module.down_proj.shape
        transposed = flag(module, "is_transposed")
        hidden, inter = (b, a) if transposed else (a, b)
        out_up = up.shape[2] if transposed else up.shape[1]
        in_up = up.shape[1] if transposed else up.shape[2]
        if in_up != hidden or out_up != (2 * inter if gated else inter) or up.shape[0] != e:
            raise UnsupportedModelError(f"{type(module).__name__}: {up_name} {tuple(up.shape)} and down_proj "
                                        f"{tuple(module.down_proj.shape)} are not a consistent experts layout")
        return cls(up_name, transposed, flag(module, "is_concatenated"), gated, flag(module, "has_bias"),
                   flag(module, "has_post_expert_norm"), e, hidden, inter)

    @property
    def up_rows(self) -> int:
        """Output rows of one expert's up (gate/up) projection: 2I for gated experts, I otherwise."""
        return 2 * self.inter if self.gated else self.inter

    def linear(self, param: torch.Tensor) -> torch.Tensor:
        """(E, out, in) view of a stored 3-D weight (a transposed view when the storage is (E, in, out))."""
        return param.transpose(1, 2) if self.transposed else param

    def gate_up_rows(self) -> tuple[slice, slice]:
        """Rows of the (2I, H) gate_up matrix holding gate and up."""
        if self.concatenated:
            return slice(0, self.inter), slice(self.inter, 2 * self.inter)
        return slice(0, 2 * self.inter, 2), slice(1, 2 * self.inter, 2)

    def matrices(self, name: str, module: nn.Module) -> list:
        """The :class:`Matrix` targets of experts module ``name``: its up (gate/up) and down projections."""
        return [Matrix(f"{name}.{self.up_name}", "expert_gate_up", self.up_rows, self.hidden, self.num_experts,
                       self.transposed, name, (name, "gate_up"), module, self),
                Matrix(f"{name}.down_proj", "expert_down", self.hidden, self.inter, self.num_experts,
                       self.transposed, name, (name, "down"), module, self)]


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """An experts stack that is a module of its own (:data:`STACKED_EXPERTS`): one 3-D parameter ``weight``
    (E, out, in) in nn.Linear orientation, each expert's matrix solved on the rows routed to it.

    Attributes:
      num_experts, rows, cols: E, out, in.
    """

    num_experts: int
    rows: int
    cols: int
    transposed: bool = False

    @classmethod
    def of(cls, module: nn.Module) -> StackLayout:
        w = getattr(module, "weight", None)
        if not isinstance(w, nn.Parameter) or w.ndim != 3:
            raise UnsupportedModelError(f"{type(module).__name__}: expected a 3-D parameter 'weight' (E, out, in)")
        return cls(*w.shape)

    def linear(self, param: torch.Tensor) -> torch.Tensor:
        return param   # stored (E, out, in)

    def matrices(self, name: str, module: nn.Module) -> list:
        """The one :class:`Matrix` of stack ``name``."""
        return [Matrix(f"{name}.weight", "expert_stack", self.rows, self.cols, self.num_experts, False, name,
                       (name, "weight"), module, self)]


@dataclasses.dataclass
class LayerTargets:
    """The quantization targets of one decoder layer (names relative to the layer)."""

    linears: dict          # name -> nn.Linear
    experts: dict          # name -> (module, ExpertsLayout, StackLayout or RowsLayout)
    skipped: list          # names of parameters left in floating point, with the reason
    dropped: frozenset = frozenset()   # relative names of matrices left out by the plan

    def matrices(self) -> list:
        """Every target :class:`Matrix` of the layer: linear modules in module order, then each experts
        module's up (gate/up) and down projections, or a stack's one. The single walk of a layer's matrices."""
        out = [Matrix(n, "linear", m.out_features, m.in_features, None, False, n, n, m)
               for n, m in self.linears.items()]
        for n, (module, lay) in self.experts.items():
            out += lay.matrices(n, module)
        return [m for m in out if m.name not in self.dropped]

    def without(self, names: set, reason: str = "excluded") -> "LayerTargets":
        """These targets less the matrices named in ``names`` (relative names): a linear module leaves; an
        experts module leaves when all of its matrices do (its calibration is still needed otherwise)."""
        if not names:
            return self
        linears = {n: m for n, m in self.linears.items() if n not in names}
        experts, skipped = {}, list(self.skipped) + [(n, reason) for n in self.linears if n in names]
        for n, (module, lay) in self.experts.items():
            own = {m.name for m in lay.matrices(n, module)}
            mine = own & names
            skipped += [(m, reason) for m in sorted(mine)]
            if len(mine) < len(own):
                experts[n] = (module, lay)
        return LayerTargets(linears, experts, skipped, self.dropped | frozenset(names))


def _is_router(name: str) -> bool:
    return any(re.search(p, name) for p in ROUTER_PATTERNS)


def layer_targets(layer: nn.Module, exclude: tuple = ()) -> LayerTargets:
    """Finds what to quantize in one decoder layer.

    Args:
      layer: a decoder layer.
      exclude: extra regular expressions over relative module names to leave unquantized.
    Raises:
      UnsupportedModelError: a 3-D (or higher) weight outside a dispatchable experts module or a stack.
    """
    linears, experts, skipped = {}, {}, []
    inside = []
    for name, module in layer.named_modules():
        if any(name == p or name.startswith(p + ".") for p in inside):
            continue
        cls = type(module).__name__
        if is_experts_module(module) or is_stacked(module) or is_row_experts(module):
            inside.append(name)
            if any(re.search(p, name) for p in exclude):
                skipped.append((name, "excluded"))
                continue
            layout = StackLayout if is_stacked(module) else RowsLayout if is_row_experts(module) else ExpertsLayout
            experts[name] = (module, layout.of(module))
            continue
        if isinstance(module, nn.Linear):
            if _is_router(name):
                skipped.append((name, "router"))
            elif any(re.search(p, name) for p in exclude):
                skipped.append((name, "excluded"))
            else:
                linears[name] = module
            continue
        if isinstance(module, nn.modules.conv._ConvNd):  # e.g. the short convolutions of linear-attention mixers
            skipped.append((name, "convolution (kept in floating point)"))
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.ndim >= 3 and sum(d > 1 for d in p.shape) <= 1:   # a vector with axes of one, e.g. (1, 1, heads, 1)
                skipped.append((f"{name}.{pname}" if name else pname, f"{cls} parameter"))
                continue
            if p.ndim == 2 and "Expert" in cls:
                raise UnsupportedModelError(
                    f"{name}.{pname} ({cls}): experts kept as rows of a 2-D parameter {tuple(p.shape)} and run by "
                    f"the model's own loop, not an experts module transformers dispatches; jgptq cannot see each "
                    f"expert's routed inputs")
            if p.ndim >= 3:
                raise UnsupportedModelError(
                    f"{name}.{pname} ({cls}): {p.ndim}-D weight {tuple(p.shape)} outside an experts module "
                    f"decorated with transformers' use_experts_implementation; jgptq cannot see its inputs")
            if p.ndim == 2:
                skipped.append((f"{name}.{pname}" if name else pname, f"{cls} parameter"))
    return LayerTargets(linears, experts, skipped)


def nothing_to_quantize(model, prefix: str, layers, targets, exclude) -> str:
    """The message of a model without a weight to quantize: everything excluded, or an architecture whose decoder
    layers hold their matrices in modules jgptq does not quantize (naming those module classes)."""
    name = type(model).__name__
    if exclude and any(t.matrices() for t in targets):
        return f"{name}: nothing to quantize (no linear or experts weights in {prefix} after exclusions {list(exclude)})"
    kinds = sorted({type(m).__name__ for layer in layers[:1] for m in layer.modules()
                    if getattr(m, "weight", None) is not None and getattr(m.weight, "ndim", 0) >= 2})
    held = f" (its matrices are in {', '.join(kinds)} modules)" if kinds else ""
    return (f"{name}: this architecture has no torch.nn.Linear or transformers experts weights in its decoder layers "
            f"({prefix}){held}; jgptq quantizes those only, so there is nothing to quantize")
