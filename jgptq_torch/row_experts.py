"""Experts kept as blocks of rows of 2-D parameters and run by the model's own loop over experts (DBRX).

DBRX's ``DbrxExperts`` holds a ``DbrxExpertGLU`` with three (E·I, H) parameters: expert ``e`` is rows
``e·I .. (e+1)·I`` of each. Its gate ``w1`` and up ``v1`` blocks are (out, in) = (I, H) matrices as nn.Linear
stores them; its down block of ``w2`` is multiplied from the right (``act(x w1ᵀ)·(x v1ᵀ) @ w2_e``), an (in, out)
matrix. transformers does not dispatch these experts through its experts interface and their classes carry no
layout flags, so the facts are listed (:data:`ROW_EXPERTS`); :class:`RowsLayout` views each parameter as a stack of
E matrices in nn.Linear orientation (views of the parameter: written back in place), and
:mod:`jgptq_torch.pipeline.row_capture` hands each expert's routed rows to the capture.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from jgptq_torch.matrix import Matrix, UnsupportedModelError

# class of the experts module -> its child holding the parameters, the gate, up and down parameters, whether an
# expert's block of down rows is stored (in, out), and the attribute giving the number of experts
ROW_EXPERTS = {"DbrxExperts": {"holder": "mlp", "gate": "w1", "up": "v1", "down": "w2", "down_transposed": True,
                               "experts": "num_experts"}}


def is_row_experts(module: nn.Module) -> bool:
    """True for an experts module of :data:`ROW_EXPERTS`."""
    return type(module).__name__ in ROW_EXPERTS


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """One (E·a, b) parameter as E matrices (E, rows, cols) in nn.Linear orientation: blocks of a rows each, the
    matrix itself (``transposed`` False: rows = a) or its transpose (True: cols = a)."""

    num_experts: int
    rows: int
    cols: int
    transposed: bool
    gated: bool = False        # each matrix is one projection (a gate or an up, never both)

    def linear(self, param: torch.Tensor) -> torch.Tensor:
        """The (E, rows, cols) view of ``param`` (no copy)."""
        if self.transposed:
            return param.view(self.num_experts, self.cols, self.rows).transpose(1, 2)
        return param.view(self.num_experts, self.rows, self.cols)


@dataclasses.dataclass(frozen=True)
class RowsLayout:
    """An experts module of :data:`ROW_EXPERTS`: E experts of width I over hidden size H.

    Attributes:
      num_experts, hidden, inter: E, H, I.
      holder, gate, up, down: the child module holding the parameters and their names.
      down_transposed: an expert's down block is stored (in, out) = (I, H).
    """

    num_experts: int
    hidden: int
    inter: int
    holder: str
    gate: str
    up: str
    down: str
    down_transposed: bool

    @classmethod
    def of(cls, module: nn.Module) -> RowsLayout:
        facts = ROW_EXPERTS[type(module).__name__]
        glu, e = getattr(module, facts["holder"]), int(getattr(module, facts["experts"]))
        shapes = {n: tuple(getattr(glu, facts[n]).shape) for n in ("gate", "up", "down")}
        rows, hidden = shapes["gate"]
        if len(set(shapes.values())) != 1 or len(shapes["gate"]) != 2 or rows % e:
            raise UnsupportedModelError(f"{type(module).__name__}: parameters {shapes} are not {e} experts' blocks "
                                        f"of rows of one (E*I, H) shape")
        return cls(e, hidden, rows // e, facts["holder"], facts["gate"], facts["up"], facts["down"],
                   facts["down_transposed"])

    def weights(self, module: nn.Module) -> tuple:
        """(gate, up, down) of every expert: (E, I, H), (E, I, H), (E, H, I) views in nn.Linear orientation."""
        glu = getattr(module, self.holder)
        return tuple(b.linear(getattr(glu, n).detach()) for n, b in zip((self.gate, self.up, self.down),
                                                                      self._blocks()))

    def _blocks(self) -> tuple:
        e, h, i = self.num_experts, self.hidden, self.inter
        down = RowBlocks(e, h, i, True) if self.down_transposed else RowBlocks(e, h, i, False)
        return RowBlocks(e, i, h, False), RowBlocks(e, i, h, False), down

    def matrices(self, name: str, module: nn.Module) -> list:
        """The :class:`jgptq_torch.matrix.Matrix` targets of experts module ``name``: gate and up (on the
        ``gate_up`` inputs), down (on the ``down`` inputs)."""
        glu, (g, u, d) = getattr(module, self.holder), self._blocks()
        return [Matrix(f"{name}.{self.holder}.{self.gate}", "expert_gate_up", g.rows, g.cols, self.num_experts,
                       False, name, (name, "gate_up"), glu, g),
                Matrix(f"{name}.{self.holder}.{self.up}", "expert_gate_up", u.rows, u.cols, self.num_experts,
                       False, name, (name, "gate_up"), glu, u),
                Matrix(f"{name}.{self.holder}.{self.down}", "expert_down", d.rows, d.cols, self.num_experts,
                       d.transposed, name, (name, "down"), glu, d)]
