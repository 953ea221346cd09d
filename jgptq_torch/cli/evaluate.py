"""``jgptq.evaluate``: a quantized checkpoint against its float model on held-out text, as llama-perplexity does.

Each side is a transformers model folder (a jgptq compressed-tensors export, a GPTQ v1 export where transformers
can load it, or the float model), a transformers model already in memory, or a ``.gguf`` file (run in llama.cpp,
:mod:`jgptq_torch.cli.llama_logits`). The text is tokenized once and cut into windows of ``n_ctx`` tokens
(:func:`jgptq.evaluation.cut_windows`); the float model runs first and the logits of each window's scored half
are kept (in a temporary file when they pass :data:`jgptq.evaluation.IN_MEMORY_BYTES`), then it is released and the quantized
model runs, window after window, against them. One model is loaded at a time.

Which runtime computes the float logits matters for GGUF files: llama.cpp computes the quantized logits, and a
float reference from torch adds the two runtimes' own difference (kernels, accumulation order, the float model's
dtype) to the KL. For a like-for-like comparison give an F32 GGUF of the float model as the reference
(``jgptq.export_gguf(model, None, "f32.gguf", float_type="f32")``); the result's notes say when the runtimes differ.
"""

from __future__ import annotations

import functools
import gc
import os
from pathlib import Path

import numpy as np

from jgptq_torch.gpu_sharing import share_gpu_with_torch
from jgptq.evaluation import DEFAULT_N_CTX, Evaluation, EvaluationError, compare, demo_texts, windows_of
from jgptq.evaluation import MIXED_RUNTIMES  # noqa: F401 - the note of a result whose runtimes differ


def _kind(spec, role: str) -> str:
    """``"model"`` (a torch module), ``"gguf"`` (a .gguf file) or ``"folder"`` (a transformers folder)."""
    if hasattr(spec, "forward") and hasattr(spec, "parameters"):
        return "model"
    if not isinstance(spec, (str, os.PathLike)):
        raise EvaluationError(f"{role}: expected a transformers model folder, a .gguf file or a transformers "
                              f"model, got {type(spec).__name__}")
    p = Path(spec)
    if p.is_file() and p.suffix.lower() == ".gguf":
        return "gguf"
    if p.is_dir():
        return "folder"
    if not p.exists():
        raise EvaluationError(f"{role} {str(p)!r} does not exist")
    raise EvaluationError(f"{role} {str(p)!r} is neither a transformers model folder nor a .gguf file")


def _label(spec) -> str:
    return type(spec).__name__ if hasattr(spec, "forward") else str(spec)


class TorchLogits:
    """A transformers causal LM, for whole windows of tokens (torch side).

    Args:
      model: a transformers causal LM; it runs on the device of its parameters.
      batch_size: windows per forward.
      owned: release the model on :meth:`close` (it was loaded here).
    """

    def __init__(self, model, batch_size: int = 4, owned: bool = False):
        self.model, self.batch_size, self.owned = model, max(1, int(batch_size)), owned
        self.device = next(model.parameters()).device
        self.runtime = f"torch on {self.device.type}"

    def windows(self, windows: np.ndarray):
        """Yields float32 (n_ctx, V) numpy logits of each int window of ``windows`` (n, n_ctx)."""
        import torch

        for a in range(0, len(windows), self.batch_size):
            ids = torch.from_numpy(np.ascontiguousarray(windows[a:a + self.batch_size])).to(self.device)
            with torch.no_grad():
                out = self.model(input_ids=ids).logits
            for row in out:
                yield row.float().cpu().numpy()

    def close(self) -> None:
        if self.owned:
            self.model = None
            gc.collect()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def load_model(folder, *, device=None, dtype: str = "auto", trust_remote_code: bool = False):
    """A transformers causal LM from a local folder (safetensors), in eval mode on ``device``.

    Args:
      folder: a float model or a quantized export transformers loads (compressed-tensors; GPTQ v1 where the
        GPTQ backend transformers uses is installed).
      device: torch device (default: cuda when available, else cpu).
      dtype: ``"auto"`` (the one config.json names) or a torch dtype name.
    Raises:
      EvaluationError: a folder transformers cannot load, with what to install where that is the cause.
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from jgptq_torch.cli.command_inputs import check_model_dir, model_dtype

    folder = check_model_dir(folder)
    dtype = model_dtype(folder, dtype)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype), use_safetensors=True,
                                                     trust_remote_code=trust_remote_code, local_files_only=True)
    except (ImportError, ValueError, RuntimeError) as exc:
        method = (json.loads((folder / "config.json").read_text()).get("quantization_config") or {}).get(
            "quant_method")
        if method == "gptq":
            raise EvaluationError(f"transformers could not load the GPTQ checkpoint {str(folder)!r} "
                                  f"({type(exc).__name__}: {exc}); transformers loads GPTQ v1 checkpoints through optimum "
                                  f"and gptqmodel (pip install optimum gptqmodel); compressed-tensors exports "
                                  f"(--export compressed-tensors) need neither") from exc
        raise
    return model.to(device).eval()


def _open(spec, kind: str, *, n_ctx, device, dtype, batch_size, threads, trust_remote_code):
    if kind == "gguf":
        from jgptq_torch.cli.llama_logits import LlamaLogits

        return LlamaLogits(spec, n_ctx, threads)
    if kind == "model":
        return TorchLogits(spec.eval(), batch_size)
    model = load_model(spec, device=device, dtype=dtype, trust_remote_code=trust_remote_code)
    return TorchLogits(model, batch_size, owned=True)


def _token_stream(texts: list, tokenizer, specs: list) -> tuple:
    """(int64 token stream with its leading BOS if the tokenizer adds one, that BOS id or None)."""
    text = "\n\n".join(t for t in texts if t.strip())
    if not text:
        raise EvaluationError("the evaluation text is empty")
    if tokenizer is None:
        folders = [s for s, k in specs if k == "folder"]
        ggufs = [s for s, k in specs if k == "gguf"]
        if folders:
            tokenizer = folders[0]
        elif ggufs:
            from jgptq_torch.cli.llama_logits import tokenize

            return tokenize(ggufs[0], text)
        else:
            raise EvaluationError("text needs a tokenizer: pass tokenizer= (a transformers tokenizer or its "
                                  "folder), or token ids as tokens=")
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        except Exception as exc:  # transformers raises several kinds here
            raise EvaluationError(f"no tokenizer could be loaded from {str(tokenizer)!r} ({type(exc).__name__}: "
                                  f"{exc}); pass one (--tokenizer DIR)") from exc
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    probe, bare = tokenizer("a")["input_ids"], tokenizer("a", add_special_tokens=False)["input_ids"]
    bos = int(probe[0]) if len(probe) > len(bare) and probe[0] == tokenizer.bos_token_id else None
    return np.asarray(([bos] if bos is not None else []) + ids, dtype=np.int64), bos


def read_texts(path) -> list:
    """The text of a UTF-8 file, or of every ``*.txt`` file of a folder (sorted by name).

    Raises:
      EvaluationError: the path does not exist, a folder without ``.txt`` files, or no text at all.
    """
    p = Path(path)
    if not p.exists():
        raise EvaluationError(f"evaluation text {str(p)!r} does not exist")
    files = sorted(f for f in p.iterdir() if f.suffix == ".txt" and f.is_file()) if p.is_dir() else [p]
    if not files:
        raise EvaluationError(f"evaluation text folder {str(p)!r} holds no .txt files")
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    if not any(t.strip() for t in texts):
        raise EvaluationError(f"evaluation text {str(p)!r} is empty")
    return texts


def _texts(text) -> tuple:
    if text is None:
        return [demo_texts()[1]], "jgptq's held-out demo text"
    if isinstance(text, os.PathLike):
        return read_texts(text), str(text)
    if isinstance(text, str):
        return [text], f"{len(text)} characters of text"
    texts = list(text)
    if not all(isinstance(t, str) for t in texts):
        raise EvaluationError("text: expected a str, a list of str, or a path (pathlib.Path) to a file or folder")
    return texts, f"{len(texts)} texts"


def evaluate(quantized, reference, text=None, *, tokens=None, n_ctx: int = DEFAULT_N_CTX, windows: int | None = None,
             tokenizer=None, device=None, dtype: str = "auto", batch_size: int = 4, threads: int | None = None,
             trust_remote_code: bool = False, log=None) -> Evaluation:
    """KL(p_float || p_quantized) per scored token, top-1 agreement and both perplexities, as llama-perplexity
    ``--kl-divergence`` defines them (windows of ``n_ctx`` tokens from an empty context, positions
    ``n_ctx // 2 .. n_ctx - 2`` scored).

    Args:
      quantized, reference: the quantized and the float model: a transformers folder, a ``.gguf`` file (run in
        llama.cpp; needs ``pip install llama-cpp-python``) or a transformers model in memory.
      text: None (jgptq's held-out demo text), a str of text, a list of them, or a ``pathlib.Path`` to a UTF-8
        file or a folder of ``.txt`` files.
      tokens: token ids instead of text: a stream (L,) cut into windows, or windows (n, n_ctx) used as they are.
      n_ctx: tokens per window; windows: evaluate at most this many (the first ones; None: all).
      tokenizer: a transformers tokenizer or its folder (default: the first model folder given; with GGUF files
        only, the reference GGUF's own vocabulary).
      device, dtype, trust_remote_code: how model folders are loaded (:func:`load_model`).
      batch_size: windows per torch forward; threads: llama.cpp threads.
      log: a callable taking a progress message, or None.
    Returns:
      a :class:`jgptq.evaluation.Evaluation` (``summary``, ``per_token``, ``table()``, ``to_json(path)``).
    """
    share_gpu_with_torch()
    specs = [(quantized, _kind(quantized, "quantized model")), (reference, _kind(reference, "float model"))]
    for spec, kind in specs:
        if kind == "gguf":   # before any model runs
            from jgptq_torch.cli.llama_logits import require

            require(spec)
    bos = None
    if tokens is not None:
        stream, source = tokens, "token ids"
    else:
        texts, source = _texts(text)
        stream, bos = _token_stream(texts, tokenizer, specs[::-1])
    ids = windows_of(stream, n_ctx, windows, bos)
    opts = dict(n_ctx=ids.shape[1], device=device, dtype=dtype, batch_size=batch_size, threads=threads,
                trust_remote_code=trust_remote_code)
    return compare(functools.partial(_open, reference, specs[1][1], **opts),
                   functools.partial(_open, quantized, specs[0][1], **opts), ids,
                   labels=(_label(quantized), _label(reference)), text=source, bos_token_id=bos, say=log)


def check_gptq_loader(quantized) -> None:
    """Refuses, before the float model runs, a GPTQ v1 folder transformers cannot load here: it loads them through
    optimum and gptqmodel (:mod:`transformers.utils` says whether they are installed)."""
    import json

    from jgptq_torch.cli.command_inputs import CommandError

    cfg = Path(quantized) / "config.json"
    if not cfg.is_file():
        return
    try:
        method = (json.loads(cfg.read_text()).get("quantization_config") or {}).get("quant_method")
    except (ValueError, AttributeError):
        return   # load_model names a broken config.json
    if method != "gptq":
        return
    from transformers import utils

    missing = [name for name, there in (("optimum", utils.is_optimum_available()),
                                        ("gptqmodel", utils.is_gptqmodel_available())) if not there]
    if missing:
        raise CommandError(f"{str(quantized)!r} is a GPTQ v1 checkpoint, which transformers loads through optimum and "
                           f"gptqmodel; {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed "
                           f"here (pip install {' '.join(missing)}); compressed-tensors exports (--export "
                           f"compressed-tensors) need neither")


def run_eval(args) -> int:
    """The ``jgptq eval`` command (``args``: the parsed options of :mod:`jgptq_torch.cli.main`): prints the table, and writes
    the JSON of ``--json``."""
    from jgptq_torch.cli.command_inputs import CommandError, log

    if args.n_ctx < 4:
        raise CommandError(f"--n-ctx {args.n_ctx}: windows need at least 4 tokens (default: {DEFAULT_N_CTX})")
    for option, value in (("--windows", args.windows), ("--batch-size", args.batch_size),
                          ("--threads", args.threads)):
        if value is not None and value < 1:
            raise CommandError(f"{option} {value}: must be at least 1")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise CommandError(f"--json {args.json}: the folder {str(Path(args.json).parent)!r} does not exist")
    check_gptq_loader(args.quantized)   # before the float model runs
    if args.quiet:
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:
            pass
    result = evaluate(args.quantized, args.float_model, Path(args.text) if args.text else None, n_ctx=args.n_ctx,
                      windows=args.windows, tokenizer=args.tokenizer, device=args.device, dtype=args.dtype,
                      batch_size=args.batch_size, threads=args.threads, trust_remote_code=args.trust_remote_code,
                      log=None if args.quiet else log)
    print(result.table())
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}")
    return 0
