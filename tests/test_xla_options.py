"""The persistent compilation cache that quantize_moe turns on: where it goes, the opt-out, a user's own folder."""

import os
import subprocess
import sys

from jgptq import xla_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import jax, jax.numpy as jnp
from jgptq import xla_options
print(xla_options.enable_compilation_cache())
print(jax.config.jax_compilation_cache_dir)
"""


def run(env):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **env)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_cache_folder_default_override_and_opt_out(tmp_path, monkeypatch):
    monkeypatch.delenv(xla_options.ENV_COMPILE_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert xla_options.compilation_cache_dir() == str(tmp_path / "jgptq" / "xla")
    monkeypatch.setenv(xla_options.ENV_COMPILE_CACHE, str(tmp_path / "mine"))
    assert xla_options.compilation_cache_dir() == str(tmp_path / "mine")
    for off in ("0", "off", "no"):
        monkeypatch.setenv(xla_options.ENV_COMPILE_CACHE, off)
        assert xla_options.compilation_cache_dir() is None


def test_enable_sets_jax_config_once_and_keeps_a_users_folder(tmp_path):
    folder = str(tmp_path / "cache")
    assert run({"JGPTQ_COMPILATION_CACHE": folder}) == [folder, folder]
    assert os.path.isdir(folder)
    assert run({"JGPTQ_COMPILATION_CACHE": "0"}) == ["None", "None"]
    theirs = str(tmp_path / "theirs")
    assert run({"JGPTQ_COMPILATION_CACHE": folder, "JAX_COMPILATION_CACHE_DIR": theirs}) == [theirs, theirs]
