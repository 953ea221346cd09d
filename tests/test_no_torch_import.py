"""``import jgptq`` and every module of the jgptq package load without importing torch (or transformers); the
public face names its objects lazily, and they are the right ones."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import importlib, pkgutil, sys
FORBIDDEN = ("torch", "transformers", "jgptq_torch")
def loaded():
    return sorted({m.split(".")[0] for m in sys.modules} & set(FORBIDDEN))
import jgptq
culprits = {"jgptq": loaded()} if loaded() else {}
import jgptq.config
assert (jgptq.QuantConfig, jgptq.MoEConfig, jgptq.PipelineConfig) == (
    jgptq.config.QuantConfig, jgptq.config.MoEConfig, jgptq.config.PipelineConfig)
if loaded():
    culprits["jgptq.QuantConfig"] = loaded()
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

# What the face promises: public name -> (module, attribute) it stands for.
FACE = {
    "quantize_moe": ("jgptq_torch.pipeline.layerwise", "quantize_moe"),
    "quantize_folder": ("jgptq_torch.source.stream", "quantize_folder"),
    "CheckpointSink": ("jgptq_torch.export.folder_sink", "CheckpointSink"),
    "export_model": ("jgptq_torch.export.checkpoint", "export_model"),
    "export_gguf": ("jgptq_torch.export.gguf.export", "export_gguf"),
    "export_imatrix": ("jgptq_torch.export.gguf.export", "export_imatrix"),
    "check_exportable": ("jgptq_torch.export.gguf.export", "check_exportable"),
    "load_layer": ("jgptq_torch.pipeline.offload", "load_layer"),
    "reload_all": ("jgptq_torch.pipeline.offload", "reload_all"),
    "QuantizeResult": ("jgptq_torch.report", "QuantizeResult"),
    "Report": ("jgptq_torch.report", "Report"),
    "QuantConfig": ("jgptq.config", "QuantConfig"),
    "MoEConfig": ("jgptq.config", "MoEConfig"),
    "PipelineConfig": ("jgptq.config", "PipelineConfig"),
    "UnsupportedModelError": ("jgptq_torch.models", "UnsupportedModelError"),
    "ResumeMismatchError": ("jgptq_torch.pipeline.resume", "ResumeMismatchError"),
    "DeviceBudgetError": ("jgptq_torch.pipeline.offload", "DeviceBudgetError"),
    "ExportError": ("jgptq_torch.export.checkpoint", "ExportError"),
    "UnsupportedGGUFModel": ("jgptq_torch.export.gguf.arch", "UnsupportedGGUFModel"),
    "GGUFSink": ("jgptq_torch.export.gguf.stream", "GGUFSink"),
    "evaluate": ("jgptq_torch.cli.evaluate", "evaluate"),
    "Evaluation": ("jgptq.evaluation", "Evaluation"),
    "EvaluationError": ("jgptq.evaluation", "EvaluationError"),
}
ERRORS = [name for name in FACE if name.endswith("Error") or name.startswith("Unsupported")]


def _run(script: str, drop=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    for name in drop:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_jgptq_imports_without_torch():
    done = _run(SCRIPT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torch-side packages: {}" in done.stdout


def test_the_face_lists_its_names():
    import jgptq
    from jgptq.version import __version__

    assert set(jgptq.__all__) == set(FACE) | {"__version__"}
    assert set(jgptq.__all__) <= set(dir(jgptq))
    assert jgptq.__version__ == __version__
    with pytest.raises(AttributeError, match="no attribute 'solve_layer'"):
        jgptq.solve_layer


def test_the_face_names_the_right_objects():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib

    import jgptq

    for name, (module, attr) in FACE.items():
        assert getattr(jgptq, name) is getattr(importlib.import_module(module), attr), name
    from jgptq import ExportError, quantize_moe  # noqa: F401  (the import statement goes through the face too)

    assert all(issubclass(getattr(jgptq, name), ValueError) for name in ERRORS)


def test_the_torch_side_of_the_face_says_what_to_install_without_torch():
    done = _run("import sys\n"
                "sys.modules['torch'] = sys.modules['transformers'] = None   # neither can be imported\n"
                "import jgptq\n"
                "assert jgptq.QuantConfig().bits == 4\n"
                "try:\n"
                "    jgptq.quantize_moe\n"
                "except jgptq.NeedsTorchError as exc:\n"
                "    assert isinstance(exc, AttributeError) and not hasattr(jgptq, 'export_gguf')\n"
                "    print(exc.__cause__.name, '|', exc)\n")
    assert done.returncode == 0, done.stderr
    name, message = done.stdout.strip().split(" | ")
    assert name in ("torch", "transformers") and "pip install 'jgptq[torch]'" in message


def test_help_of_the_face_works_without_torch():
    # pydoc reads every public name; the torch-side ones must be passed over, not end the help with an error
    done = _run("import sys\n"
                "sys.modules['torch'] = sys.modules['transformers'] = None\n"
                "import jgptq\n"
                "help(jgptq)\n")   # stdout is a pipe: pydoc writes the page without a pager
    assert done.returncode == 0, done.stderr
    assert "Help on package jgptq" in done.stdout and "class QuantConfig" in done.stdout
    assert "class PipelineConfig" in done.stdout and "needs torch" not in done.stdout


def test_importing_jgptq_changes_no_environment_variable():
    done = _run("import os, json\n"
                "before = dict(os.environ)\n"
                "import jgptq, jgptq.config, jgptq.hessian\n"
                "after = dict(os.environ)\n"
                "print(json.dumps(sorted(set(before.items()) ^ set(after.items()))))\n",
                drop=["XLA_PYTHON_CLIENT_PREALLOCATE"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
