"""The torch side asks JAX not to preallocate the GPU at its entry points, before JAX starts, keeping a value the
user set; ``import jgptq`` alone leaves the variable alone (tests/test_no_torch_import.py)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"


def _run(script: str, **env_set) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    env.pop(VAR, None)
    env.update(env_set)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_entry_point_sets_the_variable_before_jax_starts():
    out = _run("import os, jax, jgptq\n"
               "from jgptq_torch.gpu_sharing import share_gpu_with_torch\n"
               "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'), end=' ')\n"
               "share_gpu_with_torch()\n"
               "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))\n")
    assert out == "None false"


def test_a_value_the_user_set_is_kept():
    out = _run("import os\n"
               "from jgptq_torch.gpu_sharing import share_gpu_with_torch\n"
               "share_gpu_with_torch()\n"
               "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])\n", XLA_PYTHON_CLIENT_PREALLOCATE="true")
    assert out == "true"


def test_after_jax_started_the_variable_is_left_alone():
    # setting it then would claim an effect it cannot have; on the CPU there is no memory to warn about either
    out = _run("import os, warnings, jax, jax.numpy as jnp\n"
               "jnp.zeros(2).block_until_ready()\n"
               "from jgptq_torch.gpu_sharing import share_gpu_with_torch\n"
               "with warnings.catch_warnings():\n"
               "    warnings.simplefilter('error')\n"
               "    share_gpu_with_torch()\n"
               "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))\n")
    assert out == "None"


def test_the_quantize_entry_point_calls_it():
    out = _run("import os, jgptq\n"
               "try:\n"
               "    jgptq.quantize_moe(None, [], bits=4)\n"
               "except Exception:\n"
               "    pass\n"
               "print(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE'))\n")
    assert out == "false"
