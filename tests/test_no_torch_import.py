"""``import jgptq`` and every module of the jgptq package load without importing torch (or transformers)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import importlib, pkgutil, sys
FORBIDDEN = ("torch", "transformers", "interop")
def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
import jgptq
culprits = {"jgptq": loaded()} if loaded() else {}
names = sorted(m.name for m in pkgutil.walk_packages(jgptq.__path__, "jgptq."))
assert {"jgptq.hessian", "jgptq.gptq", "jgptq.config", "jgptq.flax.capture"} <= set(names), names
for name in names:
    before = loaded()
    importlib.import_module(name)
    if loaded() != before:
        culprits[name] = loaded()
print(len(names), "modules; imported torch-side packages:", culprits)
sys.exit(1 if culprits else 0)
"""


def test_jgptq_imports_without_torch():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch-side packages: {}" in done.stdout
