"""Calibration data in the forms users have, turned into padded batches with attention masks.

Accepted by :func:`batches` (and so by :func:`jgptq.quantize_moe`):

- a LongTensor of token ids, (S,) one sequence or (N, S) N sequences;
- a list of such tensors (or of lists of ints); sequences of different lengths are right-padded;
- a dict with ``input_ids`` and optionally ``attention_mask`` (tensors or nested lists), or a list of such dicts
  (what a tokenizer returns);
- text: a str or a list of str, with ``tokenizer=`` (any callable returning ``{"input_ids": ...}``); with
  ``max_length``, each text is cut into consecutive windows of that many tokens (never truncated).

Padding is marked with attention mask 0 and never reaches a Hessian. A calibration set without a single real
token raises ``ValueError``.
"""

from __future__ import annotations

import re
import warnings
from typing import NamedTuple

import torch


class Batch(NamedTuple):
    """One calibration forward: input_ids (B, S) int64 and attention_mask (B, S) int64 (1 = real token)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def _as_rows(ids, mask, what: str) -> list:
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"{what}: token ids must be integers, got {ids.dtype}")
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"{what}: token ids must be (S,) or (N, S), got shape {tuple(ids.shape)}")
    if mask is None:
        mask = torch.ones_like(ids)
    mask = torch.as_tensor(mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"{what}: attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    return [(ids[i].long(), (mask[i] != 0).long()) for i in range(ids.shape[0])]


def _tokenize(texts, tokenizer, max_length):
    """Each text tokenized whole; with ``max_length``, a text longer than that is cut into consecutive windows of
    ``max_length`` tokens (the last one shorter), as the command line cuts its text, so no token is dropped."""
    if tokenizer is None:
        raise ValueError("calibration text needs a tokenizer (pass tokenizer=...)")
    rows = []
    for k, text in enumerate(texts):
        check_text(text, f"calibration text {k}" if len(texts) > 1 else "the calibration text")
        enc = tokenizer(text)
        ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc
        for i, m in _as_rows(ids, enc.get("attention_mask") if hasattr(enc, "get") else None, "tokenized text"):
            step = max_length or max(i.shape[0], 1)
            rows.extend((i[a:a + step], m[a:a + step]) for a in range(0, max(i.shape[0], 1), step))
    return rows


def sequences(calib, tokenizer=None, max_length=None) -> list:
    """Every calibration sequence as (ids (S,), mask (S,)) int64 pairs of at most ``max_length`` tokens: text is
    cut into windows of ``max_length`` tokens; token ids longer than that are cut to it, with a warning."""
    rows = _rows(calib, tokenizer, max_length)
    if max_length is not None:
        cut = sum(max(i.shape[0] - max_length, 0) for i, _ in rows)
        if cut:   # token ids given as sequences: their length is the caller's choice, so cut, but not silently
            long = sum(i.shape[0] > max_length for i, _ in rows)
            warnings.warn(f"{long} calibration sequence{'s' if long > 1 else ''} longer than max_length="
                          f"{max_length} cut to it ({cut:,} tokens dropped); pass text with a tokenizer to have "
                          f"it cut into windows of max_length, or cut the ids yourself", stacklevel=3)
        rows = [(i[:max_length], m[:max_length]) for i, m in rows]
    return rows


def _rows(calib, tokenizer, max_length) -> list:
    if isinstance(calib, str):
        calib = [calib]
    if isinstance(calib, torch.Tensor):
        rows = _as_rows(calib, None, "calibration tensor")
    elif isinstance(calib, dict) or hasattr(calib, "keys"):
        if "input_ids" not in calib:
            raise ValueError(f"calibration dict has no 'input_ids' (keys: {sorted(calib.keys())})")
        ids = calib["input_ids"]
        mask = calib.get("attention_mask")
        if isinstance(ids, list) and ids and isinstance(ids[0], (list, torch.Tensor)):
            masks = mask if mask is not None else [None] * len(ids)
            rows = [r for i, m in zip(ids, masks) for r in _as_rows(i, m, "calibration input_ids")]
        else:
            rows = _as_rows(ids, mask, "calibration input_ids")
    elif isinstance(calib, (list, tuple)):
        if not calib:
            raise ValueError("calibration set is empty")
        if all(isinstance(c, str) for c in calib):
            rows = _tokenize(calib, tokenizer, max_length)
        elif all(isinstance(c, int) for c in calib):
            rows = _as_rows(list(calib), None, "calibration ids")
        else:
            rows = [r for c in calib for r in _rows(c, tokenizer, max_length)]
    else:
        raise TypeError(f"unsupported calibration input of type {type(calib).__name__}: pass token ids, a list of "
                        f"them, a dict with input_ids/attention_mask, or text with a tokenizer")
    return rows


def batches(calib, *, tokenizer=None, batch_size: int = 8, max_length=None, pad_id: int = 0) -> list:
    """Calibration data as a list of :class:`Batch` (right-padded, in input order).

    Raises:
      ValueError: no sequence, or no real (unmasked) token at all.
    """
    rows = sequences(calib, tokenizer, max_length)
    if tokenizer is not None and getattr(tokenizer, "pad_token_id", None) is not None:
        pad_id = int(tokenizer.pad_token_id)
    total = sum(int(m.sum()) for _, m in rows)
    if total == 0:
        raise ValueError(f"calibration set has zero tokens ({len(rows)} sequences, all empty or fully masked)")
    rows = [(i, m) for i, m in rows if int(m.sum()) > 0]
    out = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b:b + batch_size]
        length = max(i.shape[0] for i, _ in chunk)
        ids = torch.full((len(chunk), length), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(chunk), length), dtype=torch.int64)
        for r, (i, m) in enumerate(chunk):
            ids[r, : i.shape[0]] = i
            mask[r, : m.shape[0]] = m
        out.append(Batch(ids, mask))
    return out


def token_count(batch_list: list) -> int:
    """Real (unmasked) tokens in a list of batches."""
    return int(sum(int(b.attention_mask.sum()) for b in batch_list))


# Control characters other than the whitespace ones (tab, newline, vertical tab, form feed, carriage return).
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f]")
MAX_CONTROL_FRACTION = 0.1   # text with more control characters than this is binary (or UTF-16) data, not text
FAR_BELOW = 10               # the command line refuses text giving under 1/FAR_BELOW of the tokens asked for


def check_text(text: str, what: str) -> None:
    """Refuses a string that is mostly not text: more than ``MAX_CONTROL_FRACTION`` of its characters are control
    characters (tab, newline and the other whitespace controls excepted). ``what`` names it in the message.

    Raises:
      ValueError: naming ``what``, the count and the first such character's position.
    """
    found = _CONTROL.findall(text)
    if len(found) <= MAX_CONTROL_FRACTION * len(text):
        return
    first = _CONTROL.search(text)
    raise ValueError(f"{what} is not text: {len(found):,} of its {len(text):,} characters are control characters "
                     f"(the first, {first.group()!r}, at character {first.start():,}); calibrate on plain text")


def _decode(f) -> str:
    """The text of a UTF-8 file ``f`` (a leading byte-order mark dropped); refuses other bytes naming the offset."""
    data = f.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        bad = data[exc.start:exc.end]
        hint = " (it starts with a UTF-16 byte-order mark)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise ValueError(f"calibration file {str(f)!r} is not UTF-8 text{hint}: {exc.reason} at byte offset "
                         f"{exc.start:,} ({' '.join(f'0x{b:02x}' for b in bad)}); convert it to UTF-8 (e.g. "
                         f"iconv -t UTF-8) or pass another file") from None


def read_texts(path) -> list:
    """Calibration texts from a UTF-8 text file, or from every ``*.txt`` file of a folder (sorted by name).

    Raises:
      FileNotFoundError: the path does not exist; ValueError: a folder without ``.txt`` files, a file that is not
      UTF-8 (naming the byte offset of the first bad sequence) or mostly control characters, or only empty text.
    """
    from pathlib import Path

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"calibration path {str(p)!r} does not exist")
    files = sorted(f for f in p.iterdir() if f.suffix == ".txt" and f.is_file()) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"calibration folder {str(p)!r} holds no .txt files")
    texts = [_decode(f) for f in files]
    for f, text in zip(files, texts):
        check_text(text, f"calibration file {str(f)!r}")
    if not any(t.strip() for t in texts):
        raise ValueError(f"calibration set {str(p)!r} is empty (no text in {len(files)} file(s))")
    return texts


def text_tokens(texts, tokenizer) -> torch.Tensor:
    """The texts joined with blank lines and tokenized once (no special tokens): (T,) int64 token ids."""
    text = "\n\n".join(t for t in texts if t.strip())
    enc = tokenizer(text, add_special_tokens=False)
    return torch.as_tensor(enc["input_ids"] if hasattr(enc, "keys") else enc, dtype=torch.int64).reshape(-1)


def cut_windows(ids: torch.Tensor, seq_len: int, samples: int) -> torch.Tensor:
    """Consecutive windows of ``seq_len`` tokens of ``ids`` (T,) int64: (N, seq_len), N <= ``samples`` (evenly
    spaced ones kept when there are more); ``ids`` shorter than one window give one shorter sequence (1, T).

    Raises:
      ValueError: no tokens at all, or a non-positive ``seq_len`` / ``samples``.
    """
    if seq_len < 1 or samples < 1:
        raise ValueError(f"seq_len={seq_len} and samples={samples} must be positive")
    if ids.numel() == 0:
        raise ValueError("calibration set is empty: the text gives no tokens")
    if ids.numel() < seq_len:
        return ids[None]
    windows = ids[: ids.numel() // seq_len * seq_len].reshape(-1, seq_len)
    if windows.shape[0] > samples:
        pick = (torch.arange(samples) * windows.shape[0]) // samples
        windows = windows[pick]
    return windows


def token_windows(texts, tokenizer, seq_len: int, samples: int) -> torch.Tensor:
    """Calibration sequences cut from texts: (N, seq_len) int64 token ids, N <= ``samples``
    (:func:`text_tokens`, then :func:`cut_windows`)."""
    return cut_windows(text_tokens(texts, tokenizer), seq_len, samples)


def window_shortfall(tokens: int, seq_len: int, samples: int, source) -> "str | None":
    """The command line's rule for calibration text that gives fewer tokens than asked (``samples`` windows of
    ``seq_len``): refused when it fills no whole window or under 1/``FAR_BELOW`` of the tokens asked for; a
    warning (returned) when it fills fewer windows than asked; None when it fills them all.

    Raises:
      ValueError: naming ``source``, the tokens it gives and the windows they make.
    """
    windows, asked = tokens // seq_len, samples * seq_len
    if windows >= samples:
        return None
    gives = f"calibration {str(source)!r} gives {tokens:,} tokens"
    if windows == 0:
        raise ValueError(f"{gives}, not one window of --seq-len {seq_len} ({samples} x {seq_len} = {asked:,} tokens "
                         f"were asked for); give more text, or a smaller --seq-len")
    made = f"{windows} window{'s' if windows > 1 else ''} of {seq_len}"
    if windows * seq_len * FAR_BELOW < asked:
        raise ValueError(f"{gives}, {made}: under a tenth of the {asked:,} tokens asked for (--samples {samples} x "
                         f"--seq-len {seq_len}); give more text, or pass --samples {windows} to calibrate on what "
                         f"it holds")
    return (f"{gives}, {made}: fewer than the {samples} asked for (--samples {samples} x --seq-len {seq_len} = "
            f"{asked:,} tokens); calibrating on {windows} windows ({windows * seq_len:,} tokens)")


def token_floor(tokens: int, targets, prefix: str) -> "str | None":
    """A warning when the calibration set holds fewer tokens than the widest target's input columns (every
    Hessian that wide is then rank-deficient: GPTQ leans on its damping); None otherwise. ``targets``: the
    :class:`jgptq_torch.models.LayerTargets` of each decoder layer under ``prefix``."""
    widest = max(((m.cols, f"{prefix}.{i}.{m.name}") for i, t in enumerate(targets) for m in t.matrices()),
                 key=lambda c: c[0], default=(0, ""))
    if tokens >= widest[0]:
        return None
    return (f"calibration holds {tokens:,} tokens, fewer than the {widest[0]:,} input columns of {widest[1]}: "
            f"Hessians that wide are rank-deficient and GPTQ leans on damping there; give at least {widest[0]:,} "
            f"tokens (several times more is better)")
