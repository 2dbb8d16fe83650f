"""The runnable examples keep saying what their docs say."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_masked_attention_example(capsys):
    _load("masked_attention").main()
    out = capsys.readouterr().out
    assert "jaxsafe.nn  [0. 0. 0. 0.]" in out
    assert "hand-written, -inf mask  [False, False, True]" in out      # plain JAX: NaN in dv
    assert "nan_safe(hand-written)   [False, False, False]" in out
    assert "jaxsafe.nn               [False, False, False]" in out
    assert out.rstrip().endswith("give the same gradient: True")


def test_quickstart_example(capsys):
    _load("quickstart").main()
    out = capsys.readouterr().out
    assert "forward values agree: True" in out
    assert "grad(nan_safe(f))(1.)         = 0.5" in out
    assert "grad(nan_safe(f_indexed))(1.) = 0.5" in out  # the reporter's boolean index, eager
    assert "under jax.jit it raises DataDependentShapeError" in out
