"""The peers_quality benchmark's verdict at one code width: is jgptq's best row closer to the float model than every
peer row, beyond the standard error, and how long did it take beside AutoRound.

Per peer row (every row whose side is not ``jgptq``): the paired per-token KL difference ``peer - best`` over the
same scored tokens (:func:`paired`), its standard error, ``z = mean / stderr``, and ``best_lower_beyond_stderr``
(``mean > stderr``: the best jgptq row's mean KL is lower by more than one standard error of the difference). A peer
row that failed or was not run keeps its reason and counts against the claim (nothing was measured to beat).
The time ratio is the best jgptq row's quantization seconds over AutoRound's (``llmcompressor:autoround``), each the
wall time of its quantization call.
"""

from __future__ import annotations

import numpy as np

CLAIM_TIME_RATIO = 0.1   # "at <= 1/10 of AutoRound's time"
AUTOROUND = "llmcompressor:autoround"


def paired(kl_a, kl_b) -> dict:
    """Mean per-token KL difference a - b over the same tokens (float arrays (T,)), its standard error, and the share
    of tokens where b is lower."""
    d = np.asarray(kl_a, np.float64) - np.asarray(kl_b, np.float64)
    if d.size < 2:
        raise ValueError(f"paired: {d.size} token(s); a standard error needs at least 2")
    return {"mean": float(d.mean()), "stderr": float(d.std(ddof=1) / np.sqrt(d.size)),
            "share_b_lower": float(np.mean(d > 0))}


def best_row(rows: dict, side: str = "jgptq"):
    """The name of ``side``'s row with the lowest mean KL (None when none was measured)."""
    scored = [(r["kl_mean"], name) for name, r in rows.items()
              if isinstance(r, dict) and r.get("side") == side and "kl_mean" in r]
    return min(scored)[1] if scored else None


def verdict(rows: dict, per_token: dict) -> dict:
    """The claim's figures at one width.

    Args:
      rows: row name -> row dict (``side``, and ``kl_mean`` / ``quantize_s`` when measured, else ``error`` or
        ``load_error`` or ``skipped``).
      per_token: row name -> float64 (T,) per-token KL of the measured rows, on the same tokens.
    Returns:
      ``{"best": name, "best_kl", "best_s", "peers": {name: {...}}, "time_ratio_vs_autoround",
      "lower_than_every_peer", "within_time", "claim_holds"}`` (``best`` None and ``claim_holds`` False when no
      jgptq row was measured).
    """
    best = best_row(rows)
    peers = {n: r for n, r in rows.items() if isinstance(r, dict) and r.get("side") not in (None, "jgptq")}
    if best is None:
        return {"best": None, "claim_holds": False, "why": "no jgptq row was measured"}
    out = {"best": best, "best_kl": rows[best]["kl_mean"], "best_s": rows[best].get("quantize_s"), "peers": {}}
    for name, r in peers.items():
        if name not in per_token:
            why = r.get("skipped") or r.get("load_error") or r.get("error") or "not measured"
            out["peers"][name] = {"measured": False, "why": str(why)[:300], "best_lower_beyond_stderr": False}
            continue
        d = paired(per_token[name], per_token[best])
        out["peers"][name] = {"measured": True, "kl_mean": r["kl_mean"], "quantize_s": r.get("quantize_s"),
                              "minus_best": d["mean"], "minus_best_stderr": d["stderr"],
                              "z": d["mean"] / d["stderr"] if d["stderr"] > 0 else float("inf"),
                              "share_tokens_best_lower": d["share_b_lower"],
                              "best_lower_beyond_stderr": d["mean"] > d["stderr"],
                              "time_ratio_best_over_peer": (rows[best].get("quantize_s") or 0) / r["quantize_s"]
                              if r.get("quantize_s") else None}
    ar = rows.get(AUTOROUND, {})
    ratio = rows[best]["quantize_s"] / ar["quantize_s"] if "kl_mean" in ar and ar.get("quantize_s") else None
    out["time_ratio_vs_autoround"] = ratio
    out["lower_than_every_peer"] = bool(peers) and all(p["best_lower_beyond_stderr"] for p in out["peers"].values())
    out["within_time"] = ratio is not None and ratio <= CLAIM_TIME_RATIO
    out["claim_holds"] = out["lower_than_every_peer"] and out["within_time"]
    out["claim"] = (f"{best} has a lower mean KL than every peer row, by more than one standard error of the paired "
                    f"difference, at <= {CLAIM_TIME_RATIO:g} of AutoRound's quantization seconds")
    return out
