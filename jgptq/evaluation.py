"""How close a quantized model's next-token distributions are to its float model's, as llama.cpp measures it.

``llama-perplexity --kl-divergence`` tokenizes the evaluation text once, cuts the token stream into consecutive
windows of ``n_ctx`` tokens (a short tail is dropped), replaces the first token of each window with the
beginning-of-sequence token when the vocabulary adds one, runs each window from an empty context, and scores only
its second half: the logits at positions ``first = n_ctx // 2 .. n_ctx - 2``, predicting tokens
``first + 1 .. n_ctx - 1`` (``n_ctx - 1 - first`` tokens per window), so that every scored token has at least
``n_ctx / 2`` tokens of context. Per scored token:

- KL(p_float || p_quant) = sum_v p_float(v) (log p_float(v) - log p_quant(v));
- whether both models rank the same token first (top-1 agreement);
- each model's negative log likelihood of the actual next token (perplexity = exp of its mean).

Every quantity here is computed in float64 numpy from the runtimes' float32 logits (llama.cpp keeps the
reference's log-probabilities in 16-bit form; float64 avoids that rounding). This module is pure numpy: the
runtimes that produce the logits (torch, llama.cpp) live in :mod:`jgptq_torch.cli.evaluate` and
:mod:`jgptq_torch.cli.llama_logits`, and :func:`jgptq.evaluate` runs the whole comparison.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
import tempfile

import numpy as np

DEFAULT_N_CTX = 512          # llama-perplexity's default context
HELD_OUT_FRACTION = 0.2      # the last fifth of the shipped text is held out from the demo's calibration
ROWS_PER_CHUNK = 64          # scored positions converted to float64 at a time (bounds the memory of a large vocab)
IN_MEMORY_BYTES = 1 << 30    # float reference logits larger than this go to a temporary file
MIXED_RUNTIMES = ("the float logits come from {ref} and the quantized ones from {quant}, so the KL includes the "
                  "two runtimes' own difference; for a like-for-like comparison give an F32 GGUF of the float model "
                  "(jgptq.export_gguf(model, None, 'f32.gguf', float_type='f32')) as the float model")


class EvaluationError(ValueError):
    """Bad input to an evaluation (the message says what and how to fix it)."""


def first_scored(n_ctx: int) -> int:
    """The first logit position scored in a window of ``n_ctx`` tokens (llama.cpp: ``n_ctx / 2``)."""
    if int(n_ctx) < 4:
        raise EvaluationError(f"n_ctx: {n_ctx} must be at least 4 tokens")
    return int(n_ctx) // 2


def scored_slice(n_ctx: int) -> slice:
    """Positions of the logits that are scored in a window: ``first .. n_ctx - 2``."""
    return slice(first_scored(n_ctx), int(n_ctx) - 1)


def demo_texts() -> tuple:
    """The text shipped with jgptq (``jgptq/data/calibration.txt``) cut at a paragraph break into
    (calibration part, held-out part): the held-out part is its last :data:`HELD_OUT_FRACTION` or so, the default
    evaluation text, never calibrated on by ``jgptq demo``."""
    text = (importlib.resources.files("jgptq") / "data" / "calibration.txt").read_text(encoding="utf-8")
    cut = text.rfind("\n\n", 0, int(len(text) * (1 - HELD_OUT_FRACTION)))
    return text[:cut], text[cut:].strip()


def cut_windows(ids, n_ctx: int, limit: int | None = None, bos_id: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of a token stream, as llama-perplexity cuts its chunks.

    Args:
      ids: int (L,) the token stream (with its leading BOS when the vocabulary adds one).
      n_ctx: tokens per window (at least 4).
      limit: keep at most this many windows (the first ones); None keeps all.
      bos_id: when given, the first token of every window is replaced with it.
    Returns:
      int64 (n, n_ctx), n = min(L // n_ctx, limit); the tail shorter than a window is dropped.
    Raises:
      EvaluationError: fewer than ``n_ctx`` tokens, or a ``limit`` below 1.
    """
    first_scored(n_ctx)
    stream = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = stream.size // int(n_ctx)
    if limit is not None:
        if int(limit) < 1:
            raise EvaluationError(f"windows: {limit} must be at least 1 (or None for all)")
        n = min(n, int(limit))
    if n < 1:
        raise EvaluationError(f"the text gives {stream.size} tokens, fewer than one window of {n_ctx}; give more "
                              f"text or a smaller n_ctx")
    out = stream[: n * int(n_ctx)].reshape(n, int(n_ctx)).copy()
    if bos_id is not None:
        out[:, 0] = int(bos_id)
    return out


def windows_of(ids, n_ctx: int, limit: int | None = None, bos_id: int | None = None) -> np.ndarray:
    """The windows a comparison runs: int (n, n_ctx) windows used as they are (their own width is the window length;
    the first ``limit`` when ``limit`` is given), or a token stream (L,) cut by :func:`cut_windows`."""
    ids = np.asarray(ids, dtype=np.int64)
    if ids.ndim != 2:
        return cut_windows(ids, n_ctx, limit, bos_id)
    first_scored(ids.shape[1])
    return ids[:limit] if limit else ids


class _ScoredStore:
    """The float model's logits at the scored positions of every window: float32 (n, S, V), in memory or, past
    :data:`IN_MEMORY_BYTES`, in an anonymous temporary file."""

    def __init__(self):
        self.array, self.file = None, None

    def put(self, i: int, n: int, rows: np.ndarray) -> None:
        if self.array is None:
            shape = (n,) + rows.shape
            if np.prod(shape) * 4 > IN_MEMORY_BYTES:
                self.file = tempfile.TemporaryFile(prefix="jgptq-eval-")
                self.array = np.memmap(self.file, dtype=np.float32, mode="w+", shape=shape)
            else:
                self.array = np.empty(shape, np.float32)
        self.array[i] = rows

    def close(self) -> None:
        self.array = None
        if self.file is not None:
            self.file.close()


def compare(open_reference, open_quantized, windows: np.ndarray, *, labels: tuple, text: str,
            bos_token_id: int | None = None, say=None) -> Evaluation:
    """Runs the float model, then the quantized one, over ``windows`` and scores them (one model open at a time).

    Args:
      open_reference, open_quantized: callables without arguments that open a runtime: an object with
        ``runtime`` (its name), ``windows(ids)`` (yields float32 (n_ctx, V) logits of each window) and ``close()``.
      windows: int (n, n_ctx) (:func:`windows_of`).
      labels: (quantized, reference) as the result names them; text: where the text came from; bos_token_id: the
        token each window starts with, or None; say: a callable taking a progress message, or None.
    Returns:
      an :class:`Evaluation`; the float logits of the scored positions are kept in between (in a temporary file
      past :data:`IN_MEMORY_BYTES`).
    Raises:
      EvaluationError: the two models' vocabularies differ in size.
    """
    say = say or (lambda msg: None)
    n_ctx = windows.shape[1]
    scored = scored_slice(n_ctx)
    store = _ScoredStore()
    try:
        say(f"float model: {labels[1]}, {len(windows)} windows of {n_ctx} tokens")
        runner = open_reference()
        ref_runtime = runner.runtime
        try:
            for i, logits in enumerate(runner.windows(windows)):
                store.put(i, len(windows), logits[scored])
        finally:
            runner.close()
        say(f"quantized model: {labels[0]}")
        runner = open_quantized()
        quant_runtime, parts = runner.runtime, []
        try:
            for i, logits in enumerate(runner.windows(windows)):
                if logits.shape[-1] != store.array.shape[-1]:
                    raise EvaluationError(f"the quantized model has {logits.shape[-1]} logits per token and the "
                                          f"float model {store.array.shape[-1]}: not the same vocabulary")
                parts.append(token_stats(store.array[i], logits[scored], windows[i, scored.start + 1:]))
        finally:
            runner.close()
    finally:
        store.close()
    notes = () if quant_runtime == ref_runtime else (MIXED_RUNTIMES.format(ref=ref_runtime, quant=quant_runtime),)
    per_token = concat(parts)
    return Evaluation(summary=summarize(per_token), per_token=per_token, quantized=labels[0], reference=labels[1],
                      runtimes={"quantized": quant_runtime, "reference": ref_runtime}, text=text,
                      n_ctx=int(n_ctx), windows=int(len(windows)), bos_token_id=bos_token_id, notes=notes)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of float logits (..., V)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_stats(ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> dict:
    """Per-token statistics of a block of scored positions.

    Args:
      ref_logits, logits: float (T, V) logits of the reference (float) model and the evaluated model at the same
        positions.
      targets: int (T,) the actual next tokens.
    Returns:
      float64 / bool arrays (T,): ``kl`` = KL(p_ref || p) (nats, clipped at 0 against rounding), ``nll_ref`` and
      ``nll`` (negative log likelihoods of the targets, nats), ``same_top`` (both argmaxes agree).
    """
    ref_logits, logits = np.asarray(ref_logits), np.asarray(logits)
    targets = np.asarray(targets, dtype=np.int64)
    if ref_logits.shape != logits.shape or ref_logits.ndim != 2 or targets.shape != ref_logits.shape[:1]:
        raise EvaluationError(f"logits {logits.shape}, reference {ref_logits.shape} and targets {targets.shape} "
                              f"must be (T, V), (T, V) and (T,)")
    parts = []
    for a in range(0, max(len(targets), 1), ROWS_PER_CHUNK):
        b = a + ROWS_PER_CHUNK
        lp_ref, lp = log_softmax(ref_logits[a:b]), log_softmax(logits[a:b])
        rows = np.arange(lp.shape[0])
        parts.append({"kl": np.maximum(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1), 0.0),
                      "nll_ref": -lp_ref[rows, targets[a:b]], "nll": -lp[rows, targets[a:b]],
                      "same_top": np.argmax(ref_logits[a:b], -1) == np.argmax(logits[a:b], -1)})
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def window_stats(ref_windows: np.ndarray, windows: np.ndarray, tokens: np.ndarray) -> dict:
    """:func:`token_stats` over whole windows, scoring only each window's second half.

    Args:
      ref_windows, windows: float (n, n_ctx, V) logits of every position of every window (positions before
        :func:`first_scored` are never read and may hold anything).
      tokens: int (n, n_ctx) the windows' tokens.
    Returns:
      the per-token arrays of :func:`token_stats`, concatenated over windows: (n * (n_ctx - 1 - first),).
    """
    n, n_ctx = np.shape(tokens)
    s = scored_slice(n_ctx)
    parts = [token_stats(ref_windows[i][s], windows[i][s], np.asarray(tokens[i])[s.start + 1:]) for i in range(n)]
    return concat(parts)


def concat(parts: list) -> dict:
    """The per-token arrays of several :func:`token_stats` results, concatenated in order."""
    if not parts:
        raise EvaluationError("no scored tokens")
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def summarize(stats: dict) -> dict:
    """Summary of per-token statistics (:func:`token_stats`), every value a Python float or int.

    Returns: ``tokens``; ``kl_mean`` with its standard error ``kl_mean_stderr`` (sample standard deviation over
    sqrt(n); NaN for one token), ``kl_median``, ``kl_p90``, ``kl_p99``, ``kl_max`` (quantiles interpolated
    linearly, as llama.cpp does); ``same_top_rate`` and its standard error; ``ppl`` (evaluated model), ``ppl_ref``
    (reference) and ``ln_ppl_ratio`` = ln(ppl / ppl_ref).
    """
    kl = np.asarray(stats["kl"], dtype=np.float64)
    n = kl.size
    if n == 0:
        raise EvaluationError("no scored tokens")
    nll, nll_ref = np.asarray(stats["nll"], np.float64), np.asarray(stats["nll_ref"], np.float64)
    same = np.asarray(stats["same_top"], dtype=np.float64)
    return {
        "tokens": int(n),
        "kl_mean": float(kl.mean()),
        "kl_mean_stderr": float(kl.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kl_median": float(np.median(kl)),
        "kl_p90": float(np.quantile(kl, 0.90)),
        "kl_p99": float(np.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "same_top_rate": float(same.mean()),
        "same_top_stderr": float(math.sqrt(same.mean() * (1 - same.mean()) / n)),
        "ppl": float(math.exp(nll.mean())),
        "ppl_ref": float(math.exp(nll_ref.mean())),
        "ln_ppl_ratio": float(nll.mean() - nll_ref.mean()),
    }


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """The result of :func:`jgptq.evaluate`.

    Attributes:
      summary: :func:`summarize` of the scored tokens.
      per_token: the :func:`token_stats` arrays (float64 / bool, (tokens,)), window after window.
      quantized, reference: what was compared (paths, or a model's class name).
      runtimes: {"quantized": ..., "reference": ...}, e.g. ``"torch on cpu"`` or ``"llama.cpp"``.
      text: where the evaluation text came from.
      n_ctx, windows: the window length and how many windows were run.
      bos_token_id: the token each window starts with, or None (the text's own first token).
      notes: caveats of the comparison (printed under the table).
    """

    summary: dict
    per_token: dict
    quantized: str
    reference: str
    runtimes: dict
    text: str
    n_ctx: int
    windows: int
    bos_token_id: int | None = None
    notes: tuple = ()

    def table(self) -> str:
        """The summary as a short table (what ``jgptq eval`` prints)."""
        s, first = self.summary, first_scored(self.n_ctx)
        rows = [("tokens scored", f"{s['tokens']}"),
                ("KL mean", f"{s['kl_mean']:.4e} ± {s['kl_mean_stderr']:.1e}"),
                ("KL median", f"{s['kl_median']:.4e}"),
                ("KL p90", f"{s['kl_p90']:.4e}"),
                ("KL p99", f"{s['kl_p99']:.4e}"),
                ("KL max", f"{s['kl_max']:.4e}"),
                ("top-1 agreement", f"{s['same_top_rate']:.2%} ± {s['same_top_stderr']:.2%}"),
                ("perplexity quantized", f"{s['ppl']:.4f}"),
                ("perplexity float", f"{s['ppl_ref']:.4f}")]
        lines = [f"quantized: {self.quantized}, run in {self.runtimes['quantized']}",
                 f"float:     {self.reference}, run in {self.runtimes['reference']}",
                 f"text:      {self.text}; {self.windows} windows of {self.n_ctx} tokens, positions "
                 f"{first}..{self.n_ctx - 2} of each scored", ""]
        lines += [f"{name:<22}{value}" for name, value in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Everything but the per-token arrays, JSON-ready (non-finite numbers become None)."""
        first = first_scored(self.n_ctx)
        summary = {k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in self.summary.items()}
        return {"quantized": self.quantized, "reference": self.reference, "runtimes": dict(self.runtimes),
                "text": self.text, "n_ctx": self.n_ctx, "windows": self.windows, "first_scored": first,
                "scored_per_window": self.n_ctx - 1 - first, "bos_token_id": self.bos_token_id,
                "kl": "KL(p_float || p_quantized), nats per scored token", "summary": summary,
                "notes": list(self.notes)}

    def to_json(self, path) -> None:
        """Writes :meth:`to_dict` to ``path``."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
