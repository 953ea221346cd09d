"""Seeing the inputs of every weight of a decoder layer, and feeding them to a chain of statistics (JAX, via DLPack).

The statistics are pairs of pure functions (:mod:`jgptq.statistics`: the Hessian sum, the importance statistic);
:class:`Collector` applies each to every input it sees. Two mechanisms, both active only inside
:meth:`Collector.attach`:

- forward hooks on ``nn.Linear`` modules: a module's input rows feed its statistics. Modules that receive the very
  same input tensor object in one forward (q/k/v after the input norm, gate/up after the post-attention norm,
  a shared expert's gate/up) share one state: the tie is observed, not listed per model;
- the ``"jgptq_capture"`` experts implementation, registered with transformers' ``ExpertsInterface`` and selected
  with ``model.set_experts_implementation`` (:mod:`jgptq_torch.pipeline.experts_capture`): it computes the layer output like
  the eager loop and hands each expert's gate/up input rows and down input rows to the active :class:`Collector`,
  which adds them a group of experts at a time (:mod:`jgptq_torch.pipeline.routed_groups`).

Experts that transformers does not dispatch reach the same collector from hooks on their unchanged forwards: Llama
4's (:mod:`jgptq_torch.pipeline.prescaled_capture`) and stacks of E matrices that are modules of their own, JetMoe's
(:mod:`jgptq_torch.pipeline.stacked_capture`); DBRX's blocks of rows (:mod:`jgptq_torch.pipeline.row_capture`).

A collector made with ``span=(lo, hi)`` keeps the experts' statistics of experts ``lo <= e < hi`` only (entry
``e - lo`` of their stacks): a chunk of a layer's routed experts (:mod:`jgptq_torch.pipeline.expert_chunks`). It
groups only those experts; each expert's statistics are still the same bytes as a collector of every expert's,
since a slot's sums do not depend on the size of its group (the Hessian's per-slot products; the squares' fixed
pairwise tree, :func:`jgptq.hessian.slot_squares`).

Calibration modes: ``routed`` (an expert sees the tokens the router sends it) and ``all_experts`` (a statistic made
with ``all_experts``, the Hessian in that mode, sees every token at its gate/up and down inputs; the output still
uses the routed rows only, so it is exactly the routed output; gate/up of all experts then share one state).
Padding tokens (attention mask 0) never reach a statistic.

Paired statistics (the error-feedback cross statistic, :attr:`jgptq.statistics.Statistic.paired`) read each
weight's input beside the float model's input to it at the same token. A collector made with ``record=True`` (the
float stream's, run on the float layer first for each batch) keeps that batch's inputs; the run's collector, given
it as ``partner``, pairs its own rows with them (:mod:`jgptq_torch.pipeline.paired`) and feeds the paired
statistics apart from the others. Without a partner they are never fed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from jgptq_torch.dlpack import to_jax
from jgptq_torch.pipeline import paired, routed_groups
from jgptq_torch.pipeline.active_collector import ACTIVE as _ACTIVE
from jgptq_torch.pipeline.experts_capture import (IMPLEMENTATION, _grouped_on, _register,  # noqa: F401
                                                  experts_forward, experts_implementation)
from jgptq import statistics as stats


class Collector:
    """Statistics of one decoder layer's target inputs, fed by hooks and the capture implementation.

    The collector is given a chain of statistics (name -> :class:`jgptq.statistics.Statistic`) and applies each,
    in order, to every input row it sees; what they compute is theirs. Padding tokens are masked out.

    Keys: a linear module's key is the name of the first module that received the same input tensor (its tie
    leader); experts modules have stacked states ``(name, "gate_up")`` and ``(name, "down")`` with one entry per
    expert (``(name, "gate_up")`` is a single state for a statistic that sees every token, ``all_experts``); an
    experts stack of its own module has one, ``(name, "weight")`` (:meth:`stack_inputs`).

    Args:
      linears: relative name -> nn.Linear.
      experts: relative name -> (module, :class:`jgptq_torch.models.ExpertsLayout` or
        :class:`jgptq_torch.models.StackLayout`).
      statistics: name -> :class:`jgptq.statistics.Statistic` (default :func:`jgptq.statistics.calibration`: the
        float32 Hessian sum and the importance statistic).
      span: (lo, hi): the experts' statistics keep experts ``lo <= e < hi`` only, as entries ``e - lo`` (None: all).
        Routed token counts (:attr:`routed`) are kept for every expert.
      record: keep each batch's inputs of every linear module and experts module (:attr:`recorded`, cleared as
        the next batch starts), for a collector that pairs with this one (:attr:`partner`).
    """

    def __init__(self, linears: dict, experts: dict, statistics: dict = None, span=None, record: bool = False):
        self.linears, self.experts, self.span = linears, experts, span
        self.record = record
        self.recorded: dict = {}                  # record: module name -> its input in the current batch
        self.partner = None                       # a recording Collector of the float layer on the float stream
        self.statistics = dict(stats.calibration() if statistics is None else statistics)
        self.states_of = {name: {} for name in self.statistics}   # statistic name -> key -> state
        self.tie: dict = {}                       # linear name -> state key
        self.routed = {name: [0] * lay.num_experts for name, (_, lay) in experts.items()}
        self.batch_tokens = 0                     # non-padding tokens seen
        self._module_names = {id(m): n for n, (m, _) in experts.items()}
        self._seen: list = []
        self._keep = None
        self._keep_count = None
        self._handles: list = []

    @property
    def all_experts(self) -> bool:
        """Whether a statistic sees every token of every expert (the experts' forward then runs each expert on
        every token, and the routed rows of the output are computed apart)."""
        return any(s.all_experts for s in self.statistics.values())

    @property
    def states(self) -> dict:
        """key -> state of the Hessian statistic (``"hessian"``; empty without one)."""
        return self.states_of.get(stats.HESSIAN, {})

    # -- lifecycle -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def attach(self):
        """Hooks the linear modules and makes this collector the experts implementation's target."""
        for name, module in self.linears.items():
            self._handles.append(module.register_forward_hook(self._linear_hook(name)))
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._seen.clear()

    @contextlib.contextmanager
    def batch(self, keep: torch.Tensor):
        """Marks one calibration forward; ``keep`` is the (B, S) attention mask (nonzero = real token)."""
        keep = keep.reshape(-1).to(torch.bool)
        n = int(keep.sum())
        self._keep = None if n == keep.numel() else keep
        self._keep_count = keep.numel()
        self.batch_tokens += n
        self.recorded.clear()
        try:
            yield
        finally:
            self._seen.clear()
            self._keep = None

    # -- accumulation ----------------------------------------------------------------------------------------
    def _kept(self, n_exp: int) -> tuple:
        """(lo, hi): the experts of a module of ``n_exp`` experts whose statistics this collector keeps."""
        lo, hi = self.span or (0, n_exp)
        return min(lo, n_exp), min(hi, n_exp)

    def sees(self, module, e: int) -> bool:
        """Whether expert ``e`` of experts module ``module`` has statistics here (the experts forward skips the
        work of feeding the others)."""
        name = self._module_names.get(id(module))
        if name is None:
            return False
        lo, hi = self._kept(self.experts[name][1].num_experts)
        return lo <= e < hi

    def _rows_keep(self, rows: int, what: str):
        if self._keep is None:
            return None
        if rows != self._keep_count:
            raise ValueError(f"{what}: {rows} input rows cannot be aligned with the {self._keep_count} tokens of "
                             f"the attention mask; padding could not be excluded")
        return self._keep

    def _chain(self, all_experts=None) -> list:
        """(name, statistic) of the chain's unpaired statistics, in order; only those whose ``all_experts`` is the
        given one, if any."""
        return [(n, s) for n, s in self.statistics.items()
                if not s.paired and (all_experts is None or s.all_experts == all_experts)]

    def _paired_chain(self) -> list:
        """(name, statistic) of the paired statistics, when a partner's inputs are there to pair with."""
        if self.partner is None:
            return []
        return [(n, s) for n, s in self.statistics.items() if s.paired]

    def _add(self, key, x: torch.Tensor, keep, index=None, size=None, name="activations", chain=None):
        """Adds rows of x (N, C) where keep (N,) holds (None: all rows) to the states ``key`` of the statistics of
        ``chain`` (default: all): entry ``index`` of stacks of ``size`` entries, or a single state (None)."""
        chain = self._chain() if chain is None else chain
        if not chain:
            return
        if keep is not None:
            x = x[keep]
        n = x.shape[0]
        states = [self.states_of[s].get(key) for s, _ in chain]
        for start in range(0, max(n, 1), routed_groups.MAX_ROWS):
            piece = x[start:start + routed_groups.MAX_ROWS]
            m = piece.shape[0]
            if m == 0 and all(state is not None for state in states):
                break
            p = routed_groups.padded_rows(m)
            padded = F.pad(piece, (0, 0, 0, p - m)) if p != m else piece
            mask = torch.arange(p, device=piece.device) < m
            xj, mj = to_jax(padded, name=name), to_jax(mask, name=name + " mask")
            for j, (_, statistic) in enumerate(chain):
                if states[j] is None:
                    cols = x.shape[-1] // 2 if statistic.paired else x.shape[-1]
                    states[j] = statistic.init(cols, size, next(iter(xj.devices())))
                if m:
                    states[j] = statistic.update(states[j], xj, mj, index, name=name)
        for (s, _), state in zip(chain, states):
            self.states_of[s][key] = state


    def _linear_hook(self, name):
        def hook(module, args, output):
            x = args[0]
            if self.record:
                self.recorded[name] = x
            for seen, key in self._seen:
                if seen is x:
                    break
            else:
                key = None
            if key is None:
                key = name
                self._seen.append((x, key))
                rows = x.reshape(-1, x.shape[-1])
                keep = self._rows_keep(rows.shape[0], name)
                self._add(key, rows, keep, name=name)
                chain = self._paired_chain()
                if chain:
                    self._add(key, paired.linear_pairs(self.partner, name, rows), keep, name=name, chain=chain)
            if self.tie.setdefault(name, key) != key:
                raise RuntimeError(f"{name}: shares its input with {key!r} in one forward but with "
                                   f"{self.tie[name]!r} in another; the layer's data flow is not static")
        return hook

    def experts_input(self, module, hidden_states: torch.Tensor):
        """Called by :func:`experts_forward` with an experts module's (T, H) input tokens: kept when recording."""
        name = self._module_names.get(id(module))
        if self.record and name is not None:
            self.recorded[name] = hidden_states

    def expert_inputs(self, module, e: int, x: torch.Tensor, h: torch.Tensor, tok: torch.Tensor):
        """Called by :func:`experts_forward` for expert ``e`` when a statistic sees every token
        (:attr:`all_experts`): gate/up input rows x and down input rows h of every token (None for an expert this
        collector does not keep: :meth:`sees`), and the routed token ids ``tok``. Statistics of every token get
        all rows (gate/up: one state shared by the experts); the others get the routed rows."""
        name = self._module_names.get(id(module))
        if name is None:
            return
        lo, hi = self._kept(self.experts[name][1].num_experts)
        keep = self._keep
        routed_keep = None if keep is None else keep[tok]
        self.routed[name][e] += int(tok.numel() if routed_keep is None else routed_keep.sum())
        every = self._chain(all_experts=True)
        if e == 0:
            self._add((name, "gate_up"), x, self._rows_keep(x.shape[0], name), name=f"{name} gate/up", chain=every)
        if not lo <= e < hi:   # another chunk's expert (``h`` is then None)
            return
        self._add((name, "down"), h, self._rows_keep(h.shape[0], name), index=e - lo, size=hi - lo,
                  name=f"{name} down", chain=every)
        for part, rows in (("gate_up", x), ("down", h)):
            self._add((name, part), rows[tok], routed_keep, index=e - lo, size=hi - lo, name=f"{name} {part}",
                      chain=self._chain(all_experts=False))

    def routed_inputs(self, module, x: torch.Tensor, h: torch.Tensor, tok: torch.Tensor, counts: list,
                      weights: torch.Tensor = None):
        """Called once per forward by :func:`experts_forward` in routed mode with every expert's rows at once:
        gate/up inputs x (R, H) and down inputs h (R, I) sorted by expert (``counts[e]`` rows each), their
        token ids ``tok`` (R,) and routing weights ``weights`` (R,), what each row's expert output is multiplied
        by (None: 1, experts whose inputs are already scaled). Experts are accumulated in groups (a few calls per
        forward, not one per expert)."""
        name = self._module_names.get(id(module))
        if name is None:
            return
        n_exp, keep = self._count_routed(name, tok, counts)
        chain = self._paired_chain()
        pairs = paired.expert_pairs(self.partner, module, name, x, h, tok, counts) if chain else None
        for j, (part, rows) in enumerate((("gate_up", x), ("down", h))):
            what = f"{name} {'gate/up' if part == 'gate_up' else part}"
            self._add_grouped((name, part), rows, counts, keep, n_exp, what, weights)
            if chain:
                self._add_grouped((name, part), pairs[j], counts, keep, n_exp, what, weights, chain=chain)

    def stack_inputs(self, module, x: torch.Tensor, tok: torch.Tensor, counts: list, weights: torch.Tensor = None):
        """Called once per forward of an experts stack (:class:`jgptq_torch.models.StackLayout`) with the rows it
        multiplies: x (R, C) sorted by expert (``counts[e]`` rows each), their token ids ``tok`` (R,) and routing
        weights ``weights`` (R,) (None: 1). Its one state is ``(name, "weight")``."""
        name = self._module_names.get(id(module))
        if name is None:
            return
        if self._paired_chain():
            raise NotImplementedError(f"{name}: a method reading the float model's inputs (error_cross) does not "
                                      "yet pair an experts stack's rows")
        n_exp, keep = self._count_routed(name, tok, counts)
        self._add_grouped((name, "weight"), x, counts, keep, n_exp, name, weights)

    def _count_routed(self, name: str, tok: torch.Tensor, counts: list) -> tuple:
        """Adds the non-padding rows of each expert to :attr:`routed`; returns (E, the rows' keep mask or None)."""
        n_exp = self.experts[name][1].num_experts
        keep = None if self._keep is None else self._keep[tok]
        real = list(counts)
        if keep is not None:
            count_t = torch.as_tensor(counts, device=tok.device)
            expert = torch.repeat_interleave(torch.arange(n_exp, device=tok.device), count_t)
            real = torch.zeros(n_exp, dtype=torch.long, device=tok.device).index_add_(0, expert, keep.long()).tolist()
        for e, n in enumerate(real):
            self.routed[name][e] += n
        return n_exp, keep

    def _add_grouped(self, key, rows, counts: list, keep, n_exp: int, name: str, weights=None, chain=None):
        """Adds routed ``rows`` (sorted by expert, ``counts[e]`` each) to the stacked states ``key`` of the
        statistics of ``chain`` (default: every unpaired one), a group of experts at a time
        (:func:`jgptq_torch.pipeline.routed_groups.add_grouped`); with a span, the kept experts only."""
        chain = self._chain() if chain is None else chain
        states = routed_groups.add_grouped(chain, [self.states_of[s].get(key) for s, _ in chain], rows, counts,
                                           keep, self._kept(n_exp), name, weights)
        if states is None:
            return
        for (s, _), state in zip(chain, states):
            self.states_of[s][key] = state

    # -- results ---------------------------------------------------------------------------------------------
    def result(self, statistic: str, key):
        """The finalized state ``key`` of the statistic named ``statistic``; None if never fed."""
        state = self.states_of[statistic].get(key)
        return None if state is None else self.statistics[statistic].finalize(state)

    def hessian(self, key):
        """(finalized Hessian (C, C) or (E, C, C), token counts as a Python int or list) of the ``"hessian"``
        statistic; None if never fed."""
        return self.result(stats.HESSIAN, key)

    def importance_statistic(self, key):
        """The :class:`jgptq.imatrix.ImatrixEntry` (float32 (E, C) sums of squared inputs, float32 (E,) token
        counts) of the ``"imatrix"`` statistic over the tokens the weight saw (routed tokens only for experts, in
        every calibration mode); None if never fed."""
        return self.result(stats.IMATRIX, key)

    def release(self):
        """Drops every state (frees device memory)."""
        for states in self.states_of.values():
            states.clear()
