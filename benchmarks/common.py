"""Shared helpers of the benchmark harness: timing, machine description, result files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from typing import Callable

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes (``--out``, ``--small``)."""
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=doc)
    p.add_argument("--out", default=os.path.join(RESULTS, f"{name}.json"), help="result JSON path")
    p.add_argument("--small", action="store_true", help="tiny sizes: a smoke run on any machine")
    return p


def integer_grid_options(p: argparse.ArgumentParser, *, windows: int, model=None) -> None:
    """The options of the benchmarks that quantize a trained quality model onto integer grids and measure its KL on
    held-out text: code widths, group size, calibration and evaluation windows, training steps, and with ``model``
    (its default) the choice of trained model."""
    p.add_argument("--bits", default="4,3", help="comma-separated code widths (default 4,3)")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--calib-seqs", type=int, default=128, help="calibration windows of --calib-len bytes")
    p.add_argument("--calib-len", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=256, help="evaluation window in tokens (bytes)")
    p.add_argument("--windows", type=int, default=windows, help="held-out windows evaluated")
    if model is not None:
        p.add_argument("--model", default=model, choices=("quality", "deep"), help="which trained model")
    p.add_argument("--train-steps", type=int, default=None, help="training steps (default: the trained model's)")


def machine() -> dict:
    """What ran the benchmark: host, accelerator, library versions."""
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "host_cpus": os.cpu_count(), "platform": platform.platform()}
    try:
        import jax

        info["jax"] = jax.__version__
        info["jax_devices"] = [f"{d.platform}:{d.device_kind}" for d in jax.devices()]
    except Exception as exc:  # pragma: no cover - reporting only
        info["jax"] = f"unavailable: {exc}"
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["torch_device"] = torch.cuda.get_device_name(0)
    except Exception:
        info["torch"] = None
    return info


def time_calls(fn: Callable[[], object], sync: Callable[[object], object], *, warmup: int = 1, repeat: int = 5,
               min_seconds: float = 0.0) -> dict:
    """Wall time of ``sync(fn())`` over ``repeat`` runs after ``warmup`` runs: median, min, all (seconds)."""
    for _ in range(warmup):
        sync(fn())
    times = []
    start = time.perf_counter()
    while len(times) < repeat or (time.perf_counter() - start) < min_seconds:
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return {"median_s": statistics.median(times), "min_s": min(times), "runs": len(times)}


def write(path: str, result: dict) -> str:
    """Writes ``result`` (with the machine description) as JSON and prints where."""
    result = dict(result)
    result.setdefault("machine", machine())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=False, default=float)
        f.write("\n")
    print(f"wrote {path}")
    return path
