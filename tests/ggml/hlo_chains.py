"""Float-conversion chains in optimized HLO: what XLA:GPU's SimplifyFPConversions would collapse.

XLA:GPU (with ``xla_allow_excess_precision``, the default) replaces every chain of two or more floating-point
``convert`` instructions by a single conversion, dropping any rounding the inner links performed. XLA:CPU does not
run that pass, so CPU results cannot show the damage; this module finds such chains in the HLO that XLA:CPU
optimized (the shared simplifiers have already run, e.g. the folding of bitcast round trips). Fusion boundaries
are looked through (the GPU pass runs before fusion), and so are data-movement instructions, which other passes
move converts across.
"""

from __future__ import annotations

import re

_FLOAT = re.compile(r"^(f16|bf16|f32|f64|f8\w*)\[")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)(?:\{[^}]*\})?\s+([\w\-]+)\((.*?)\)(.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_MOVES = {"bitcast", "copy", "reshape", "broadcast", "transpose", "slice"}


def _parse(text):
    instrs, roots, comp_of = {}, {}, {}
    comp = None
    for line in text.splitlines():
        if not line.startswith(" ") and "{" in line and "=" not in line.split("{")[0]:
            m = _COMP.match(line)
            comp = m.group(1) if m else None
            continue
        m = _INSTR.match(line)
        if not m or comp is None:
            continue
        name, shape, op, args, rest = m.groups()
        operands = re.findall(r"%([\w.\-]+)", args)
        calls = re.search(r"calls=%?([\w.\-]+)", rest)
        param = int(args) if op == "parameter" and args.strip().isdigit() else None
        instrs[name] = dict(shape=shape, op=op, operands=operands, calls=calls.group(1) if calls else None,
                            comp=comp, param=param)
        comp_of.setdefault(comp, {})
        if param is not None:
            comp_of[comp][param] = name
        if line.lstrip().startswith("ROOT"):
            roots[comp] = name
    return instrs, roots, comp_of


def convert_chains(hlo_text: str) -> list[str]:
    """Descriptions ``"a <- b"`` of float converts whose input is (through fusions and data movement) another
    float convert, in optimized HLO text (``jax.jit(f).lower(...).compile().as_text()``)."""
    instrs, roots, _ = _parse(hlo_text)
    callers = {}
    for name, ins in instrs.items():
        if ins["op"] == "fusion" and ins["calls"]:
            callers[ins["calls"]] = name

    def producer(name, depth=0):
        ins = instrs.get(name)
        if ins is None or depth > 64:
            return None
        if ins["op"] == "parameter" and ins["comp"] in callers:
            outer = instrs[callers[ins["comp"]]]
            return producer(outer["operands"][ins["param"]], depth + 1)
        if ins["op"] == "fusion" and ins["calls"] in roots:
            return producer(roots[ins["calls"]], depth + 1)
        if ins["op"] in _MOVES and ins["operands"]:
            return producer(ins["operands"][0], depth + 1)
        return name

    found = []
    for name, ins in instrs.items():
        if ins["op"] != "convert" or not _FLOAT.match(ins["shape"]) or not ins["operands"]:
            continue
        src = producer(ins["operands"][0])
        if src is not None and instrs[src]["op"] == "convert" and _FLOAT.match(instrs[src]["shape"]):
            found.append(f"{ins['shape'].split('[')[0]} {name} <- {instrs[src]['shape'].split('[')[0]} {src}")
    return found
