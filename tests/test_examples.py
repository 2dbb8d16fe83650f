"""The runnable examples keep saying what their docs say."""

import importlib.util
import pathlib

import numpy as np
import pytest
from helpers import assert_close

import jaxsafe

pytestmark = pytest.mark.no_leak_check

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


def test_equinox_example_matches_the_hand_fix():
    plain, safe, hand = _load("equinox_model").gradients()
    assert np.isnan(plain).all()
    assert_close(safe, hand)


def test_optax_example_trains_as_the_hand_fix():
    example = _load("optax_loop")
    assert np.isnan(example.train(example.loss, steps=2)[0]).all()
    safe, safe_loss = example.train(jaxsafe.nan_safe(example.loss))
    hand, hand_loss = example.train(example.loss_by_hand)
    assert_close(safe, hand, rtol=1e-5)
    assert np.isfinite(safe_loss) and abs(float(safe_loss) - float(hand_loss)) < 1e-5


def test_pair_energy_example_forces_and_hessian():
    (plain, safe, hand), (h_safe, h_hand) = _load("pair_energy").forces_and_hessians()
    assert np.isnan(plain).any()
    assert_close(safe, hand)
    assert_close(h_safe, h_hand, rtol=1e-5, atol=1e-6)


def test_piecewise_hessian_example():
    (g_plain, g_safe, g_hand), (h_plain, h_safe, h_hand) = \
        _load("piecewise_hessian").derivatives()
    assert np.isnan(g_plain).any() and np.isnan(h_plain).any()
    assert_close(g_safe, g_hand)
    assert_close(h_safe, h_hand)


def test_diagnostics_example(capsys):
    _load("diagnose_buggy").main()
    out = capsys.readouterr().out
    assert "guarded log (value guard)" in out
    assert "leak: argument 0 entries [2, 0]" in out
    assert "genuine: argument 0 entries [1, 0], [1, 1]" in out
    assert "normalize fails" in out and "normalize_fixed passes" in out
