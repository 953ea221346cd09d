"""Engine programs kept as serialized exports between runs: same bytes from the store, keys, opt-out, bad files."""

import jax
import numpy as np
import pytest

from jgptq import QuantConfig, gptq
from jgptq.methods import gptq as gptq_method
from jgptq.parallel import engine, program_store, programs
from jgptq.parallel.experts import _Solver


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A fresh store folder and no compiled program kept in this process."""
    monkeypatch.setenv("JGPTQ_COMPILATION_CACHE", str(tmp_path))
    monkeypatch.setattr(programs, "_compiled", {})
    monkeypatch.setattr(programs, "_io_compiled", {})
    return tmp_path / program_store.FOLDER


def _inputs(rng, experts=2, rows=16, cols=256):
    w = rng.standard_normal((experts, rows, cols)).astype(np.float32)
    x = rng.standard_normal((4 * cols, cols)).astype(np.float32) * np.exp(rng.uniform(-1, 1, cols))
    h = np.broadcast_to((x.T @ x / len(x)).astype(np.float32), (experts, cols, cols)).copy()
    return w, h


def _run(fn, w, h):
    out = engine.map_experts(fn, (w, h, None), (0, 0, None))
    return jax.tree.map(np.asarray, out)


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("fn", [_Solver(QuantConfig(bits=4, group_size=128)),
                                gptq_method.GPTQOrPlain(QuantConfig(format="q4_k", block_size=128))],
                         ids=["int4", "q4_k-guard"])
def test_stored_program_gives_the_traced_bytes(fn, store, monkeypatch, rng):
    w, h = _inputs(rng)
    monkeypatch.setenv("JGPTQ_COMPILATION_CACHE", "0")
    traced = _run(fn, w, h)                       # store off: the program traced as always
    monkeypatch.setenv("JGPTQ_COMPILATION_CACHE", str(store.parent))
    programs._compiled.clear()
    first = _run(fn, w, h)                        # exported and stored
    files = sorted(store.glob("*.jaxexport"))
    assert len(files) == 1
    _same(traced, first)

    programs._compiled.clear()                    # as a new process: only the file is left

    def no_export(*a, **k):
        raise AssertionError("traced again although the store holds the program")

    monkeypatch.setattr(jax.export, "export", no_export)
    loaded = _run(fn, w, h)
    _same(traced, loaded)
    assert sorted(store.glob("*.jaxexport")) == files


def test_a_file_that_does_not_load_is_replaced(store, rng, caplog):
    fn = _Solver(QuantConfig(bits=4, group_size=128))
    w, h = _inputs(rng)
    want = _run(fn, w, h)
    (path,) = store.glob("*.jaxexport")
    path.write_bytes(b"not an export")
    programs._compiled.clear()
    with caplog.at_level("WARNING", logger="jgptq.parallel"):
        got = _run(fn, w, h)
    _same(want, got)
    assert "does not load" in caplog.text
    assert path.read_bytes() != b"not an export"


def test_opt_out_writes_nothing(tmp_path, monkeypatch, rng):
    monkeypatch.setenv("JGPTQ_COMPILATION_CACHE", "off")
    monkeypatch.setattr(programs, "_compiled", {})
    assert program_store.folder() is None
    _run(_Solver(QuantConfig(bits=4, group_size=128)), *_inputs(rng))
    assert not list(tmp_path.rglob("*.jaxexport"))


def test_keys_name_the_program_and_its_setting():
    a = _Solver(QuantConfig(bits=4, group_size=128))
    b = _Solver(QuantConfig(bits=3, group_size=128))
    parts = ((0, 0, None), 1)
    assert program_store.key(a, parts) == program_store.key(_Solver(QuantConfig(bits=4, group_size=128)), parts)
    assert program_store.key(a, parts) != program_store.key(b, parts)
    assert program_store.key(a, parts) != program_store.key(a, ((0, 0, None), 2))
    # Functions whose behaviour their repr does not name are never stored: outside the package, or with an
    # object address in their repr (a closure, a codec holding a function).
    assert program_store.stable_name(lambda w, h, i: w) is None
    assert program_store.stable_name(np.sum) is None
    codec = _Solver(QuantConfig(bits=4, group_size=128), codec=gptq.ggml_codec("q8_0"))
    assert program_store.stable_name(codec) is None


def test_source_digest_follows_every_source_file(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not source")

    def digest():
        program_store.source_digest.cache_clear()
        return program_store.source_digest(pkg)

    first = digest()
    (pkg / "notes.txt").write_text("changed, still not source")
    assert digest() == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    changed = digest()
    assert changed != first
    (pkg / "sub" / "b.py").rename(pkg / "b.py")       # same bytes under another path
    assert digest() not in (first, changed)
    program_store.source_digest.cache_clear()
    assert len(program_store.source_digest()) == 64


def test_the_store_keeps_the_most_recently_used_entries(tmp_path, store, monkeypatch, rng):
    import os

    store.mkdir(parents=True)
    for i, age in enumerate((300, 200, 100)):      # three old entries of 1000 bytes, the first the oldest
        p = store / f"old{i}.jaxexport"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (p.stat().st_atime - age, p.stat().st_mtime - age))
    monkeypatch.setattr(program_store, "MAX_BYTES", 2500)
    fn = _Solver(QuantConfig(bits=4, group_size=128))
    _run(fn, *_inputs(rng))                        # a new entry of about 100 KB: over the limit with any old one
    names = sorted(p.name for p in store.glob("*.jaxexport"))
    assert len(names) == 1 and not names[0].startswith("old")
    (new,) = store.glob("*.jaxexport")
    t = new.stat().st_mtime
    for name, when in (("a", t - 50), ("b", t + 50)):      # one used before the new entry, one after it
        p = store / f"{name}.jaxexport"
        p.write_bytes(b"y" * 1000)
        os.utime(p, (when, when))
    program_store.prune(store, limit=new.stat().st_size + 1000)    # room for the new entry and one more
    assert sorted(p.name for p in store.glob("*.jaxexport")) == sorted([new.name, "b.jaxexport"])
    program_store.prune(store, limit=1000)
    assert [p.name for p in store.glob("*.jaxexport")] == ["b.jaxexport"]
