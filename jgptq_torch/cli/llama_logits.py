"""GGUF files run in llama.cpp, through the ``llama_cpp`` package (llama-cpp-python's bindings to its C library).

- :class:`LlamaLogits`: the logits of every position of token windows, each window from an empty context (as
  ``llama-perplexity`` evaluates its chunks: one batch of ``n_ctx`` tokens, every position's logits kept);
- :func:`logits`: the same for a whole array of windows at once;
- :func:`tokenize`: a GGUF's own tokenizer (for text when no transformers tokenizer is at hand).

Nothing here needs torch. Without the package every entry point raises :class:`jgptq.evaluation.EvaluationError`
saying how to install it.
"""

from __future__ import annotations

import os

import numpy as np

from jgptq.evaluation import EvaluationError

INSTALL = "pip install llama-cpp-python"


def available() -> bool:
    """True when the ``llama_cpp`` package imports."""
    try:
        import llama_cpp  # noqa: F401
    except Exception:
        return False
    return True


def require(path) -> object:
    """The ``llama_cpp`` module, or an :class:`EvaluationError` naming ``path`` and the install command."""
    try:
        import llama_cpp
    except Exception as exc:
        raise EvaluationError(f"{path}: GGUF files run in llama.cpp, which needs the llama_cpp package "
                              f"({type(exc).__name__}: {exc}); install it with: {INSTALL}") from None
    return llama_cpp


def default_threads() -> int:
    """Threads llama.cpp runs on by default: every core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


class LlamaLogits:
    """A GGUF model in llama.cpp, for whole windows of ``n_ctx`` tokens.

    Args:
      path: the .gguf file.
      n_ctx: tokens per window.
      threads: CPU threads (default: :func:`default_threads`).
    """

    runtime = "llama.cpp"

    def __init__(self, path, n_ctx: int, threads: int | None = None):
        llama_cpp = require(path)
        if not os.path.isfile(path):
            raise EvaluationError(f"GGUF file {str(path)!r} does not exist")
        threads = int(threads or default_threads())
        self.path, self.n_ctx = str(path), int(n_ctx)
        self.llm = llama_cpp.Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=self.n_ctx,
                                   n_ubatch=self.n_ctx, logits_all=True, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)

    def windows(self, windows: np.ndarray):
        """Yields float32 (n_ctx, V) logits of each int window of ``windows`` (n, n_ctx), each from an empty
        context."""
        windows = np.asarray(windows)
        if windows.ndim != 2 or windows.shape[1] != self.n_ctx:
            raise EvaluationError(f"windows {windows.shape}: expected (n, {self.n_ctx})")
        for row in windows:
            self.llm.reset()
            self.llm.eval([int(t) for t in row])
            yield np.array(self.llm.scores[: self.n_ctx], dtype=np.float32)

    def close(self) -> None:
        """Frees the model and its context."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.close()


def logits(path, windows: np.ndarray, *, threads: int | None = None) -> np.ndarray:
    """float32 (n, n_ctx, V) logits of every position of each int window (n, n_ctx), each from an empty context."""
    windows = np.asarray(windows)
    runner = LlamaLogits(path, windows.shape[1], threads)
    try:
        return np.stack(list(runner.windows(windows)))
    finally:
        runner.close()


def tokenize(path, text: str) -> tuple:
    """The GGUF's own tokenization of ``text``, as llama-perplexity tokenizes its input.

    Returns:
      (int64 (L,) token ids, with the vocabulary's BOS first when it adds one; that BOS id or None).
    """
    llama_cpp = require(path)
    if not os.path.isfile(path):
        raise EvaluationError(f"GGUF file {str(path)!r} does not exist")
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    try:
        plain = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        probe, bare = llm.tokenize(b"a", add_bos=True, special=False), llm.tokenize(b"a", add_bos=False)
    finally:
        llm.close()
    bos = int(probe[0]) if len(probe) > len(bare) else None
    return np.asarray(([bos] if bos is not None else []) + list(plain), dtype=np.int64), bos
