"""Every ``JGPTQ_*`` environment variable jgptq reads: what it overrides and where it is read.

They override where or how a run works (the solver path, compile options, caches, memory limits, how layers move,
how errors are shown); what a run computes is set by :class:`jgptq.config.PipelineConfig` alone. Each module named
here reads its variable itself; this table is the one list of them, and README's "Environment variables" section
is :func:`markdown_table` of it (tests check both). Pure Python.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["OVERRIDES", "Override", "markdown_table"]


class Override(NamedTuple):
    name: str          # the variable
    values: str        # what it may hold
    overrides: str     # the setting it overrides, and that setting's default
    read_in: str       # the module that reads it (a path in the repository)
    when: str          # when it is read


OVERRIDES = (
    Override("JGPTQ_SOLVER_KERNEL", "`auto`, `xla`, `pallas`",
             "the GPTQ in-block solve: `auto` (default) runs the fused Pallas kernel on CUDA GPUs and the XLA loop "
             "elsewhere; `xla` the XLA loop everywhere; `pallas` the kernel everywhere (interpret mode off the GPU)",
             "jgptq/kernels/inblock.py", "when a solve is traced"),
    Override("JGPTQ_SOLVER_TILING", "`rows,warps,stages`, e.g. `8,1,1`",
             "the fused kernel's tiling (default: `jgptq.kernels.inblock.Tiling()`)",
             "jgptq/kernels/inblock.py", "when a solve is traced"),
    Override("JGPTQ_TRITON_GEMM", "`1` (or `true`, `yes`, `on`)",
             "the GEMMs of jgptq's compiled programs on GPUs: XLA's autotuned Triton kernels instead of cuBLAS "
             "(default: cuBLAS, which compiles several times faster)",
             "jgptq/xla_options.py", "when `jgptq.hessian` is first imported and when the expert engine compiles"),
    Override("JGPTQ_COMPILATION_CACHE", "a folder, or `0` / `off`",
             "where compiled programs and traced engine programs persist between runs (default: "
             "`$XDG_CACHE_HOME/jgptq/xla`, else `~/.cache/jgptq/xla`); `0` turns both caches off",
             "jgptq/xla_options.py", "when `quantize_moe` starts, and by the program store"),
    Override("JGPTQ_WARM_UP", "`1` or `0` (or `true`/`false`, `yes`/`no`, `on`/`off`)",
             "whether a new layer's GPTQ solve programs (GGML ones with their guard and decode) compile ahead on "
             "worker threads beside its calibration (default: on accelerators only)",
             "jgptq_torch/pipeline/solve.py", "when a layer of shapes not seen before is calibrated"),
    Override("JGPTQ_DEVICE_MEMORY_LIMIT", "bytes, with an optional `K`/`M`/`G`/`T` suffix (powers of 1024)",
             "the memory each device is taken to have in the expert engine's room check, as `memory_limit=` does; "
             "never more than the device has (default: what the device reports; CPU devices: unlimited)",
             "jgptq/parallel/memory.py", "at each room check without `memory_limit=`"),
    Override("JGPTQ_STAGED_MOVES", "`0`",
             "how decoder layers move to and from a CUDA device: plain `module.to` copies instead of pinned "
             "staging buffers on worker threads (default: `1`, staged)",
             "jgptq_torch/pipeline/offload.py", "when the module is imported"),
    Override("JGPTQ_TRACEBACK", "any non-empty value",
             "how the `jgptq` command shows an input error: the full traceback, as `--traceback` (default: one "
             "`jgptq: error:` line)",
             "jgptq_torch/cli/main.py", "when a command fails"),
)


def markdown_table() -> str:
    """The README's table of :data:`OVERRIDES`."""
    lines = ["| variable | values | overrides | read in (when) |", "|---|---|---|---|"]
    lines += [f"| `{o.name}` | {o.values} | {o.overrides} | `{o.read_in}` ({o.when}) |" for o in OVERRIDES]
    return "\n".join(lines) + "\n"
