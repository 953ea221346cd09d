"""Checks of ``jgptq quantize`` that need the model folder's files but not its weights: run before the tokenizer and
the model are loaded, so that a run that cannot finish says so in seconds, with what to do.

- :func:`check_device`: the ``--device`` exists on this machine.
- :func:`check_gguf_model`: llama.cpp can run the model as its config.json describes it (``--export gguf``).
- :func:`check_tokenizer_files`: the tokenizer folder holds the files a tokenizer is built from.
- :func:`check_tokenizer`: the loaded tokenizer has a vocabulary (transformers builds an empty one silently).
"""

from __future__ import annotations

from pathlib import Path

from jgptq_torch.cli.command_inputs import CommandError

# Files a transformers tokenizer is built from; any one of these sets will do.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("spiece.model",), ("sentencepiece.bpe.model",),
                       ("vocab.json", "merges.txt"), ("vocab.txt",), ("tiktoken.model",))


def check_device(device) -> None:
    """Refuses a ``--device`` torch cannot run on here (no such device type, no CUDA device, an index past the
    devices there are), before anything is loaded. ``device``: the option's text, or None (the default)."""
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise CommandError(f"--device {device}: not a torch device ({exc}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = torch.version.cuda or "none (a CPU-only build)"
            raise CommandError(f"--device {device}: torch sees no CUDA device on this machine (torch "
                               f"{torch.__version__}, CUDA {built}); leave --device out or pass --device cpu to run "
                               f"on the CPU, or install a CUDA build of torch where there is a GPU")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise CommandError(f"--device {device}: this machine has {count} CUDA device{'s' if count > 1 else ''} "
                               f"(cuda:0 .. cuda:{count - 1})")
    elif dev.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise CommandError(f"--device {device}: torch has no MPS device on this machine; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps", "xpu", "meta") and not hasattr(torch, dev.type):
        raise CommandError(f"--device {device}: torch has no {dev.type!r} backend here; use cpu or cuda")


def check_gguf_model(model_dir: Path, trust_remote_code: bool) -> None:
    """Refuses, from config.json alone, a model the GGUF exporter would refuse after loading it (an architecture
    it does not write, routing llama.cpp computes differently, ...); the message says what to do instead."""
    from transformers import AutoConfig

    from jgptq_torch.export.gguf.arch import UnsupportedGGUFModel, arch_of_config

    cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    name = (getattr(cfg, "architectures", None) or [type(cfg).__name__.replace("Config", "")])[0]
    try:
        arch_of_config(cfg, name)
    except UnsupportedGGUFModel as exc:
        raise CommandError(f"{model_dir / 'config.json'}: {exc}") from None


def check_gguf_tokenizer(model_dir: Path, tokenizer, trust_remote_code: bool) -> None:
    """Refuses a tokenizer the GGUF exporter cannot write (one llama.cpp would tokenize differently), from the
    tokenizer and config.json, before a streamed run reads any layer."""
    from transformers import AutoConfig

    from jgptq_torch.export.gguf.vocab import vocab_metadata

    cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    vocab = getattr(cfg, "vocab_size", None) or getattr(getattr(cfg, "text_config", None), "vocab_size", None)
    try:
        vocab_metadata(tokenizer, int(vocab))
    except NotImplementedError as exc:
        raise CommandError(str(exc)) from exc


def check_tokenizer_files(tok_dir: Path, given: bool) -> None:
    """Refuses a tokenizer folder without any file a tokenizer is built from (transformers would build an empty
    tokenizer from its config alone, and the calibration text would give no tokens). ``given``: the folder came
    from ``--tokenizer`` (else it is the model folder)."""
    tok_dir = Path(tok_dir)
    if not tok_dir.is_dir():
        raise CommandError(f"--tokenizer {str(tok_dir)!r} is not a folder")
    if any(all((tok_dir / f).is_file() for f in files) for files in TOKENIZER_FILE_SETS):
        return
    present = sorted(p.name for p in tok_dir.iterdir() if p.name.startswith(("tokenizer", "vocab", "merges",
                                                                             "special_tokens")))
    wanted = ", ".join(" + ".join(files) for files in TOKENIZER_FILE_SETS)
    have = f" (it has {', '.join(present)})" if present else ""
    fix = "pass a folder that has them" if given else "copy them from the model's source, or pass --tokenizer DIR"
    raise CommandError(f"no tokenizer files in {str(tok_dir)!r}{have}: a tokenizer needs one of {wanted}; {fix}")


def check_tokenizer(tokenizer, tok_dir) -> None:
    """Refuses a loaded tokenizer whose vocabulary is empty (it would turn any text into no tokens)."""
    try:
        size = len(tokenizer)
    except TypeError:   # a tokenizer without a length: nothing to check here
        return
    if size == 0:
        raise CommandError(f"the tokenizer loaded from {str(tok_dir)!r} has an empty vocabulary: its files are "
                           f"incomplete; copy the tokenizer files from the model's source, or pass --tokenizer DIR")
