"""``python -m benchmarks <name> [options]`` runs ``benchmarks/<name>.py``'s ``main(argv)``.

Every benchmark runs jgptq and its anchor side by side in one process and writes
``benchmarks/results/<name>.json`` (or ``--out PATH``) with both figures and their ratio.
``python -m benchmarks --list`` lists them.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import benchmarks


def available() -> list[str]:
    skip = {"common", "__main__"}
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.ispkg and m.name not in skip)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print("usage: python -m benchmarks <name> [options]\n\nbenchmarks:\n  " + "\n  ".join(available()))
        return 0
    name = argv[0]
    if name not in available():
        print(f"unknown benchmark {name!r}; available: {', '.join(available())}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{name}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
