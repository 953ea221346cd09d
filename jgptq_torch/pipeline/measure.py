"""The measurement of ``target_bpw``'s first pass: what every candidate format costs every free matrix.

The float model runs layer by layer through the pipeline's own layer step, with :class:`Measure` as its hook, but
each layer's outputs come from its float weights (the calibration forward's own outputs), so every layer is
measured against float inputs and no candidate's error leaks into another layer's figures. For each layer, its free matrices are solved under every candidate (the
run's method and the candidate's plan, :func:`jgptq.bucket.quantize_bucket`) and each matrix's cost is
``1/2 G * s * tr((W - Q) H (W - Q)^T) / 2`` (:mod:`jgptq_torch.pipeline.sensitivity`).

What is solved. GPTQ solves the rows of a matrix independently of each other given its Hessian (and a GGML block
or an integer group lies within one row), so ``tr((W - Q) H (W - Q)^T)`` is a sum over rows and any set of rows
gives an unbiased estimate of it. The rows of experts (a fused experts parameter, or the per-expert modules of an
experts group) are most of a MoE layer's weights and every one of their groups holds many matrices: of each, one
row in :func:`row_stride` (:data:`EXPERT_ROW_STRIDE`, less where the sample would not fill a chunk; evenly spaced,
from an offset that differs between experts) is solved and its figure scaled by the rows over the sample. Other
matrices (attention, shared experts, dense MLPs) are solved whole.

Grid-search candidates. The IQ1/IQ2/IQ3 encoders (:data:`GRID_SEARCH`) cost several times a k-quant's solve, so
such a candidate is scaled from the other candidate of fewest bits that is not one (:func:`scaled_by`, e.g.
``q3_k``), measured first as above: of every matrix stack, only the ``ceil(count / EXPERT_SHARE)`` experts that
reference costs most (:func:`scaled_experts`; a single matrix: itself) are solved, on one chunk's worth of their
sample (:func:`thin_rows`: a whole attention matrix on one row in ``rows / 128``), and the stack's costs are the
reference's times the ratio of the two formats' errors over those same rows (each expert weighted as its own
estimate would be). Both formats' errors follow the same rows and Hessians, so the ratio varies far less than
either figure, and the costly solves drop to about one chunk per matrix and a quarter of the experts.
``stride=0`` measures exhaustively instead
(:func:`whole_costs`: every matrix solved whole, as the run solves it); ``python -m benchmarks target_bpw_pass
--reference`` compares the allocations of the two (``benchmarks/results/target_bpw_pass.json``).

One program per candidate. The rows to solve are cut into chunks of :data:`CHUNK_ROWS` rows, each with its
matrix's Hessian, token count and importance, and a layer's chunks of one candidate and width go through
:func:`jgptq.bucket.quantize_bucket` :data:`CHUNKS_PER_CALL` at a time (the last call padded with repeats whose
results are dropped), so one compiled program serves every matrix shape, layer and call of that candidate. The
method's own choices are then made per chunk (GPTQ's guard against the plain GGML encoding keeps the lower of the
two per chunk, not per matrix); a routed expert below the layer's token threshold gets the same fallback as in the
run, and a linear module that saw any token is solved, as in the run.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jgptq import plan as plan_mod
from jgptq.bucket import MatrixPlan, Stack, quantize_bucket
from jgptq.objective import hessian_loss
from jgptq_torch.pipeline import importance
from jgptq_torch.pipeline.hooks import end_placement
from jgptq_torch.pipeline.solve import layer_stacks, solve_layer
from jgptq_torch.pipeline.step import Hook, LayerStep

EXPERT_ROW_STRIDE = 8   # one row in this many of every expert matrix is solved
CHUNK_ROWS = 128        # rows of one solved chunk
CHUNKS_PER_CALL = 8     # chunks of one quantize_bucket call
# formats whose encoder is a grid-constrained search (several times a k-quant's solve): measured on a subsample
GRID_SEARCH = frozenset({"iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s"})
EXPERT_SHARE = 4        # a grid-search candidate is solved on one expert in this many (at least one) of a stack


def row_stride(matrix, group: str, stride: int = EXPERT_ROW_STRIDE) -> int:
    """One row in how many of ``matrix`` is solved: 1 but for experts (a fused experts parameter, or a linear
    module of an experts group; ``group``: its :func:`jgptq_torch.pipeline.sensitivity.group_name`), where it is
    ``stride`` or less, so that every expert's sample fills at least one chunk of :data:`CHUNK_ROWS` rows."""
    if matrix.layout is None and group == matrix.name:
        return 1
    return max(1, min(stride, matrix.rows // CHUNK_ROWS))


def sampled(matrix, group: str) -> bool:
    """Whether only a sample of ``matrix``'s rows is solved (:func:`row_stride` above 1)."""
    return row_stride(matrix, group) > 1


def measured_rows(rows: int, expert: int, stride: int) -> np.ndarray:
    """int64 row indices solved of a (rows, C) matrix, expert ``expert`` of its stack: every row with ``stride``
    1, else one in ``stride`` from offset ``expert % stride`` (all rows of a matrix shorter than the stride)."""
    if stride == 1 or rows < stride:
        return np.arange(rows)
    return np.arange(expert % stride, rows, stride)


class _Chunk(NamedTuple):
    param: str
    expert: int
    rows: np.ndarray       # indices into the matrix's rows
    weight: jax.Array      # (CHUNK_ROWS, C): the rows, padded with repeats of the last
    hessian: object        # (C, C) or None
    tokens: int
    importance: object     # (C,) or None


def scaled_by(fmt: str, candidates: dict, share: int = EXPERT_SHARE):
    """The candidate whose measured costs a grid-search ``fmt`` (:data:`GRID_SEARCH`) is scaled from: the other
    candidate of fewest bits that is not one (``candidates``: format -> :class:`Candidate`); None where ``fmt`` is
    measured on the sample itself (not a grid search, no such candidate, or ``share`` 1)."""
    if share <= 1 or fmt not in GRID_SEARCH:
        return None
    others = [f for f in candidates if f not in GRID_SEARCH]
    return min(others, key=lambda f: (candidates[f].bits, f)) if others else None


def thin_rows(rows: np.ndarray) -> np.ndarray:
    """The rows a scaled candidate (:func:`scaled_by`) solves of an expert's sample ``rows``: one in
    ``len(rows) // CHUNK_ROWS`` of them (at least one chunk; all of a shorter sample)."""
    return rows[::max(1, len(rows) // CHUNK_ROWS)]


def scaled_experts(ref_costs: np.ndarray, share: int = EXPERT_SHARE) -> np.ndarray:
    """int64 indices of the experts a scaled candidate solves of a stack whose reference candidate costs
    ``ref_costs`` (count,): the ``ceil(count / share)`` most costly (ties: the lower index), sorted."""
    k = -(-len(ref_costs) // share)
    return np.sort(np.argsort(-np.asarray(ref_costs, np.float64), kind="stable")[:k])


def _chunks(m, param: str, stack, stride: int, threshold: int, experts=None, thin: bool = False) -> list:
    """The chunks of one free matrix stack (module docstring): of ``experts`` (default every one), on their
    :func:`thin_rows` with ``thin``."""
    out = []
    weight = stack.weight
    for e in range(m.count) if experts is None else experts:
        rows = measured_rows(m.rows, e, stride)
        rows = thin_rows(rows) if thin else rows
        h = stack.hessian if stack.hessian is None or stack.hessian.ndim == 2 else stack.hessian[e]
        tokens = int(stack.tokens[e])
        if m.layout is None and tokens >= 1:   # a linear module is solved once reached (plan threshold 1)
            tokens = max(tokens, threshold)
        imp = None if stack.importance is None else stack.importance[e]
        for start in range(0, len(rows), CHUNK_ROWS):
            part = rows[start:start + CHUNK_ROWS]
            padded = np.concatenate([part, np.full(CHUNK_ROWS - len(part), part[-1])])
            out.append(_Chunk(param, e, part, weight[e][padded], h, tokens, imp))
    return out


@jax.jit
def _row_errors(weight, solved, hessian):
    """Per-row ``(W - Q) H (W - Q)^T / 2``: float32 (n, R) of (n, R, C) weights and (n, C, C) Hessians."""
    with jax.default_matmul_precision("highest"):
        d = solved.astype(jnp.float32) - weight.astype(jnp.float32)
        return jnp.sum((d @ hessian) * d, axis=-1) / 2


def _solve_chunks(chunks: list, plan, threshold: int, devices) -> np.ndarray:
    """float64 (len(chunks), CHUNK_ROWS) per-row errors of the chunks solved under ``plan`` (module docstring)."""
    out = []
    for start in range(0, len(chunks), CHUNKS_PER_CALL):
        part = chunks[start:start + CHUNKS_PER_CALL]
        call = part + [part[-1]] * (CHUNKS_PER_CALL - len(part))
        stacks = [Stack(f"{c.param}[{c.expert}]", c.weight[None], c.hessian, [c.tokens], f"{c.param}/{c.expert}",
                        None if c.importance is None else jnp.asarray(c.importance)[None]) for c in call]
        solved = quantize_bucket(stacks, plan, threshold=threshold, devices=devices)
        hessians = jnp.stack([jnp.asarray(c.hessian, jnp.float32) for c in call])
        errors = _row_errors(jnp.stack([c.weight for c in call]),
                             jnp.concatenate([s.weight for s in solved]), hessians)
        out.append(np.asarray(errors, np.float64)[:len(part)])
    return np.concatenate(out)


def _scale(collector, m, stack, gains, param) -> np.ndarray:
    """float64 (count,) ``1/2 G s`` of a matrix stack (module docstring)."""
    seen = collector.routed.get(m.module_name) if m.layout is not None else stack.tokens
    gain = gains.get(param, np.ones(m.count)) if gains is not None else np.ones(m.count)
    return 0.5 * np.asarray(gain, np.float64) * np.asarray(seen, np.float64) / max(collector.batch_tokens, 1)


def layer_costs(collector, stacks: list, free: dict, gains, threshold: int, devices,
                stride: int = EXPERT_ROW_STRIDE, share: int = EXPERT_SHARE) -> dict:
    """param -> {format: float64 (count,) costs} of one calibrated layer's free ``stacks`` ((Matrix, param,
    Stack) triples), estimated from one row in ``stride`` of the experts (:func:`sampled`), grid-search candidates
    scaled from a cheaper one's (:func:`scaled_by`; ``share`` 1: each measured itself; module docstring)."""
    out: dict = {}
    jobs: dict = {}     # (format, plan, cols) -> chunks
    scale, base, scaled = {}, {}, []
    for m, param, stack in stacks:
        step = row_stride(m, free[param].group, stride)
        scale[param] = _scale(collector, m, stack, gains, param)
        if stack.hessian is None:
            out[param] = {f: np.zeros(m.count) for f in free[param].candidates}
            continue
        chunks = _chunks(m, param, stack, step, threshold)
        candidates = free[param].candidates
        for fmt, cand in candidates.items():
            out.setdefault(param, {})[fmt] = np.zeros(m.count)
            ref = scaled_by(fmt, candidates, share)
            if ref is not None:
                scaled.append((m, param, stack, step, fmt, cand, ref))
                continue
            plan = MatrixPlan(cand.plan.method, cand.plan.quant, True)
            jobs.setdefault((fmt, plan, m.cols), []).extend(chunks)
        base[param] = np.asarray([len(measured_rows(m.rows, e, step)) for e in range(m.count)], np.float64)
        scale[param] = scale[param] * m.rows / base[param]
    row_errors = _run_jobs(jobs, out, threshold, devices, {p: m for m, p, _ in stacks})
    jobs, thin = {}, {}
    for m, param, stack, step, fmt, cand, ref in scaled:
        chosen = scaled_experts(out[param][ref] * scale[param], share)
        chunks = _chunks(m, param, stack, step, threshold, chosen, thin=True)
        jobs.setdefault((fmt, MatrixPlan(cand.plan.method, cand.plan.quant, True), m.cols), []).extend(chunks)
        thin[(param, fmt)] = ref, chosen
    thin_errors = _run_jobs(jobs, {}, threshold, devices, {p: m for m, p, _ in stacks})
    for (param, fmt), (ref, chosen) in thin.items():
        errs, ref_errs = thin_errors[(param, fmt)], row_errors[(param, ref)]
        m = next(mm for mm, p, _ in stacks if p == param)
        num = den = 0.0
        for e in chosen:    # both sums over the same solved rows, weighted as the expert's estimate would be
            rows = thin_rows(measured_rows(m.rows, e, row_stride(m, free[param].group, stride)))
            w = scale[param][e] * base[param][e] / len(rows)
            num, den = num + w * errs[e, rows].sum(), den + w * ref_errs[e, rows].sum()
        out[param][fmt] = out[param][ref] * (num / den if den > 0 else 1.0)
    for param, by_format in out.items():
        for fmt in by_format:
            by_format[fmt] = by_format[fmt] * scale[param]
    return out


def _run_jobs(jobs: dict, sums: dict, threshold: int, devices, matrices: dict) -> dict:
    """Solves ``jobs`` ((format, plan, cols) -> chunks); adds each chunk's error to ``sums[param][format]`` where
    that is present, and returns (param, format) -> float64 (count, rows) per-row errors (0 where not solved)."""
    rows: dict = {}
    for (fmt, plan, _), chunks in sorted(jobs.items(), key=lambda kv: (kv[0][0], kv[0][2])):
        errors = _solve_chunks(chunks, plan, threshold, devices)
        for c, err in zip(chunks, errors):
            m = matrices[c.param]
            rows.setdefault((c.param, fmt), np.zeros((m.count, m.rows)))[c.expert, c.rows] = err[:len(c.rows)]
            if fmt in sums.get(c.param, {}):
                sums[c.param][fmt][c.expert] += err[:len(c.rows)].sum()
    return rows


@jax.jit
def _output_error(weight, solved, hessian):
    """tr((W - Q) H (W - Q)^T) / 2 per matrix: (n,) float32 of (n, R, C) weights and (C, C) or (n, C, C) H."""
    return hessian_loss(weight, solved, hessian, fixed_order=False) / 2


def whole_costs(collector, stacks: list, free: dict, gains, threshold: int, devices) -> dict:
    """:func:`layer_costs` measured exhaustively: every matrix solved whole, as the run solves it (one
    :func:`jgptq_torch.pipeline.solve.solve_layer` per candidate: the matrices that have it, one bucket per shape);
    the reference the sampled estimate is judged against."""
    out: dict = {}
    for fmt in sorted({f for _, p, _ in stacks for f in free[p].candidates}):
        chosen = [s for s in stacks if fmt in free[s[1]].candidates]
        plan = plan_mod.Plan({p: free[p].candidates[fmt].plan for _, p, _ in chosen}, {}, [], [])
        for m, param, stack, res in solve_layer(chosen, plan, threshold, devices=devices):
            cost = np.zeros(m.count)
            if stack.hessian is not None:
                cost = _scale(collector, m, stack, gains, param) * np.asarray(
                    _output_error(stack.weight, res.weight, jnp.asarray(stack.hessian)), np.float64)
            out.setdefault(param, {})[fmt] = cost
    return out


class Measure(Hook):
    """The measurement as the hook of the layer step (:mod:`jgptq_torch.pipeline.step`) of a probe run
    (:class:`jgptq_torch.pipeline.run_setup.Run`): every free matrix (``free``: the run's
    :attr:`jgptq_torch.pipeline.sensitivity.Layout.free`) measured under each of its candidates, layer by layer on
    float inputs (module docstring), into :attr:`costs` (param -> {format: float64 (count,) costs}). ``gains``:
    param -> per-expert gains, or None (1); ``stride``: experts' rows sampled one in ``stride`` (0: every matrix
    solved whole, :func:`whole_costs`); ``share``: grid-search candidates solved on one expert in ``share`` and
    scaled from a cheaper candidate (:func:`scaled_by`; 1: each measured itself).

    It places the layers itself (each fetched before its step and put back after it; whole layers: no chunks of
    routed experts, whose samples would be other rows) and ends each step after its calibration, whose outputs
    (the float layer's) are the next layer's inputs. Each layer's time is its ``sensitivity`` stage."""

    def __init__(self, free: dict, gains, stride: int = EXPERT_ROW_STRIDE, share: int = EXPERT_SHARE):
        self.free, self.gains, self.stride, self.share = free, gains, stride, share
        self.costs: dict = {}
        self.t0 = 0.0

    def start(self, run, first: int) -> None:
        run.placement.chunks = {}
        run.placement.prepare()

    def before_layer(self, run, i: int) -> None:
        self.t0 = time.perf_counter()
        run.placement.fetch(i)

    def before_calibrate(self, run, step: LayerStep) -> None:
        step.keep_outputs = True

    def after_calibrate(self, run, step: LayerStep) -> None:
        i, collector, cfg = step.index, step.collector, run.cfg
        stats = importance.layer_imatrix(collector, run.prefix, i, step.target)
        stacks = [s for s in layer_stacks(collector, step.target, f"{run.prefix}.{i}", run.plan, cfg,
                                          stats if run.given is None else run.given) if s[1] in self.free]
        threshold = cfg.moe.threshold(collector.batch_tokens)
        self.costs.update(
            layer_costs(collector, stacks, self.free, self.gains, threshold, run.devices, self.stride, self.share)
            if self.stride
            else whole_costs(collector, stacks, self.free, self.gains, threshold, run.devices))
        collector.release()
        step.next_inputs = step.outputs

    def after_layer(self, run, i: int, hidden) -> None:
        run.placement.put_back(i)
        run.report.add_time(i, "sensitivity", time.perf_counter() - self.t0)

    def close(self, run, error) -> None:
        end_placement(run.placement, error is not None)


def work_ratio(free: dict, stride: int = EXPERT_ROW_STRIDE, share: int = EXPERT_SHARE) -> float:
    """Rows solved by the first pass (every candidate; experts' rows one in :func:`row_stride` of ``stride``, 0:
    all; scaled candidates on their experts' :func:`thin_rows`) over the rows the run that follows solves (module
    docstring)."""
    solved = total = 0
    for _, group, m, candidates in free.values():
        step = row_stride(m, group, stride) if stride else 1
        samples = [measured_rows(m.rows, e, step) for e in range(m.count)]
        for fmt in candidates:
            if stride and scaled_by(fmt, candidates, share) is not None:
                solved += sum(len(thin_rows(r)) for r in samples[:-(-m.count // share)]) * m.cols
            else:
                solved += sum(len(r) for r in samples) * m.cols
        total += m.count * m.rows * m.cols
    return solved / max(total, 1)
