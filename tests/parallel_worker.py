"""Subprocess side of tests/test_parallel.py: runs jgptq.parallel on N simulated CPU devices (or as one of several
jax.distributed processes) and saves every result to an npz file for the parent to compare byte for byte.

    python -m tests.parallel_worker INPUTS.npz OUT.npz SCENARIO [--processes P --process-id I --port N]

XLA_FLAGS (device count) must be set by the caller, before this module starts JAX.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def _flat(prefix: str, tree, out: dict):
    for field, value in tree._asdict().items() if hasattr(tree, "_asdict") else tree.items():
        if value is not None:
            out[f"{prefix}/{field}"] = np.asarray(value)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs")
    ap.add_argument("out")
    ap.add_argument("scenario", choices=["devices", "room", "multiprocess"])
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--extras", action="store_true", help="also uneven counts, tied Hessians, encodes")
    args = ap.parse_args(argv)

    import jax

    import jgptq.parallel as jp
    from jgptq import QuantConfig
    from jgptq import hessian as hs

    if args.scenario == "multiprocess":
        jp.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.process_id)
    data = np.load(args.inputs)
    w, h = data["weights"], data["hessians"]
    cfg = QuantConfig(**{k: v.item() for k, v in np.load(args.inputs.replace(".npz", "_cfg.npz")).items()})
    out: dict = {"num_devices": np.int32(len(jax.devices()))}

    if args.scenario in ("devices", "multiprocess"):
        _flat("all", jp.solve_experts(w, h, cfg, gather_to="host"), out)
    if args.scenario == "devices" and args.extras:
        # uneven count (padding; inputs as arrays on another device), tied Hessian, per-expert sequences
        devs = jax.devices()
        _flat("uneven", jp.solve_experts(jax.device_put(w[:-1], devs[1]), jax.device_put(h[:-1], devs[-1]), cfg),
              out)
        seq_w = [jax.device_put(x, devs[-1 - i % len(devs)]) for i, x in enumerate(w)]
        _flat("tied", jp.solve_experts(seq_w, h[0], cfg), out)
        # the imatrix-only path: a plain round-to-nearest encode with importance, sharded and per device
        rtn = _rtn_encode
        _flat("encode", dict(zip(("codes", "scale", "zero"), jp.encode_experts(rtn, w, data["importance"]))), out)
        # a GGML codec: plain encodes with importance, and GPTQ with the format's group updates
        from jgptq.ggml import get_format

        q4_0 = get_format("q4_0")
        out["ggml_encode"] = np.asarray(jp.encode_experts(q4_0.encode, w, data["importance"]))
        _flat("ggml_gptq", jp.solve_experts(w, h, QuantConfig(format="q4_0"), importance=data["importance"]), out)
        named = {f"w{i}": jax.device_put(x, devs[i % len(devs)]) for i, x in enumerate(w)}
        enc = jp.encode_on_devices(rtn, named, {k: data["importance"][i] for i, k in enumerate(named)})
        out["encode_devices_ok"] = np.bool_(all(next(iter(enc[k][0].devices())) == next(iter(named[k].devices()))
                                                for k in named))
        for i, k in enumerate(named):
            _flat(f"encode_dev{i}", dict(zip(("codes", "scale", "zero"), enc[k])), out)
    if args.scenario == "room":
        devs = jax.devices()
        # device 3 has no room at all; the others get a limit below the one-shot peak
        full = jp.plan_solve(w, h, cfg, gather_to="host")
        unit = jp.plan_solve(w[:1], h[:1], cfg, devices=devs[:1], gather_to="host").predicted_peak
        limit = {d: unit + (unit // 4 if i < 3 else -unit) for i, d in enumerate(devs)}
        plan = jp.plan_solve(w, h, cfg, memory_limit=limit, gather_to="host")
        out.update(full_peak=np.int64(full.predicted_peak), unit_peak=np.int64(unit),
                   plan_peak=np.int64(plan.predicted_peak), plan_chunks=np.int32(plan.num_chunks),
                   plan_devices=np.int32(len(plan.devices)), plan_idle=np.int32(len(plan.idle)),
                   plan_limit=np.int64(min(limit[d] for d in plan.devices)),
                   idle_is_dev3=np.bool_(devs[3] in plan.idle and devs[3] not in plan.devices))
        _flat("room", jp.solve_experts(w, h, cfg, memory_limit=limit, gather_to="host"), out)
        # one expert fewer on the devices with room: the program just planned is run again, nothing compiled (not
        # the one-device probes: every device with room takes work)
        from jgptq.parallel import engine

        compiled = set(engine._compiled)
        again = jp.plan_solve(w[:-1], h[:-1], cfg, devices=devs[:3], memory_limit=limit, gather_to="host")
        out.update(reuse_devices=np.int32(len(again.devices)), reuse_compiled=np.int32(len(set(engine._compiled)
                                                                                         - compiled)))
        _flat("reuse", jp.solve_experts(w[:-1], h[:-1], cfg, plan=again, gather_to="host"), out)
        jp.plan_solve(w[:2], h[:2], cfg, devices=devs[:1], gather_to="host")          # a one-device program of 2
        two = jp.plan_solve(w[:2], h[:2], cfg, devices=devs[:3], memory_limit=8 * unit, gather_to="host")
        out["two_devices"] = np.int32(len(two.devices))                               # not reused on one device
        # Hessian partials accumulated on several devices, merged onto the solving devices
        x = data["activations"]
        partials = [hs.DevicePartials(w.shape[-1]) for _ in range(len(w))]
        for e, p in enumerate(partials):
            for j, xb in enumerate(np.split(x[e], 4)):
                p.accumulate(jax.device_put(xb, devs[(e + j) % len(devs)]))
        plan = jp.plan_solve(w, jax.ShapeDtypeStruct(h.shape, h.dtype), cfg, gather_to="host")
        states = jp.merge_partials(partials, plan)
        out["merged_on_plan"] = np.bool_(all(next(iter(s.hessian_sum.devices())) == plan.device_of(i)
                                             for i, s in enumerate(states)))
        merged = [hs.finalize(s) for s in states]
        out["merged_hessians"] = np.stack([np.asarray(m) for m in merged])
        _flat("merged", jp.solve_experts(w, merged, cfg, plan=plan, gather_to="host"), out)
        try:
            jp.plan_solve(w, h, cfg, memory_limit=unit // 2)
            out["memory_error"] = np.bool_(False)
        except MemoryError:
            out["memory_error"] = np.bool_(True)
    if jax.process_index() == 0:
        np.savez(args.out, **out)
    return 0


def _rtn_encode(weight, importance):
    """Round-to-nearest 4-bit codes, one grid per row, the importance weighting the fitted range."""
    from jgptq import QuantConfig
    from jgptq.quantizers import uniform

    cfg = QuantConfig(bits=4, group_size=-1, sym=False)
    scaled = weight * importance[None, :] / importance.mean()
    grid = uniform.fit(scaled, cfg)
    codes = uniform.quantize(weight, grid.scale[:, None], grid.zero[:, None], cfg.maxq)
    return codes.astype("uint8"), grid.scale, grid.zero


if __name__ == "__main__":
    sys.exit(main())
