"""The command line (`python -m jaxsafe explain`, the `jaxsafe` script) and
`jaxsafe.testing.assert_no_leaks` (issue 16)."""

import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import jaxsafe
from jaxsafe import _cli
from jaxsafe.testing import assert_no_leaks

pytestmark = pytest.mark.no_leak_check
ROOT = pathlib.Path(__file__).resolve().parent.parent

SAFE_MODULE = textwrap.dedent("""\
    import jax.numpy as jnp


    def root(x, scale=1.0):
        ok = x > 0
        return jnp.sum(jnp.where(ok, jnp.sqrt(jnp.where(ok, x, 1.0)), 0.0)) * scale


    def leaky_root(x, scale=1.0):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)) * scale  # the leak


    NOT_A_FUNCTION = 3
    """)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_model.py").write_text(SAFE_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_model", raising=False)  # each test's own file
    return tmp_path / "user_model.py"


def test_a_module_of_examples_with_a_guard_exits_1(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    assert _cli.main(["explain", "examples.quickstart:f", "--arg", "f32[]"]) == 1
    out = capsys.readouterr().out
    assert "examples/quickstart.py:16:" in out and "guarded pow" in out
    assert "its lanes are dropped by select_n" in out


def test_nothing_to_guard_exits_0_and_static_values_are_json(user_module, capsys):
    assert _cli.main(["explain", "user_model:root", "--arg", "f32[8,3]",
                      "--static", "scale=2.5"]) == 0
    assert capsys.readouterr().out == "nothing to guard: the program runs unchanged\n"


def test_a_leak_exits_1_and_diff_prints_the_jaxprs(user_module, capsys):
    assert _cli.main(["explain", "user_model:leaky_root", "--arg", "f32[4]", "--diff"]) == 1
    out = capsys.readouterr().out
    assert "user_model.py:10:" in out and str(user_module.parent) not in out
    assert "+++ rewritten" in out and "# <- guarded sqrt" in out


@pytest.mark.parametrize("argv, message", [
    (["explain", "no_such_module:f", "--arg", "f32[]"], "no module named 'no_such_module'"),
    (["explain", "user_model:missing", "--arg", "f32[]"], "module 'user_model' has no 'missing'"),
    (["explain", "user_model:NOT_A_FUNCTION"], "is a int, not a function"),
    (["explain", "user_model", "--arg", "f32[]"], "write package.module:function"),
    (["explain", "user_model:root", "--arg", "f32[3,"], "bad --arg 'f32[3,'"),
    (["explain", "user_model:root", "--arg", "x32[3]"], "bad --arg 'x32[3]'"),
    (["explain", "user_model:root", "--arg", "f32[]", "--static", "scale"], "bad --static"),
    (["explain", "user_model:root", "--arg", "f32[]", "--static", "mode=sum"], "is not JSON"),
])
def test_usage_errors_exit_2_with_a_message(user_module, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["explain"])
    assert exit_.value.code == 2


def test_parse_arg_reads_dtype_and_shape():
    assert _cli.parse_arg("f32[8,3]") == ((8, 3), "float32")
    assert _cli.parse_arg("i32[]") == ((), "int32")
    assert _cli.parse_arg("bool[ 2 ]") == ((2,), "bool")


def test_python_dash_m_and_the_console_script(user_module):
    for command in ([sys.executable, "-m", "jaxsafe"],
                    [str(pathlib.Path(sys.executable).parent / "jaxsafe")]):
        proc = subprocess.run(command + ["explain", "user_model:leaky_root", "--arg", "f32[4]"],
                              capture_output=True, text=True, cwd=user_module.parent)
        assert proc.returncode == 1, proc.stderr
        assert "guarded sqrt" in proc.stdout


# --------------------------------------------------------------------------- assert_no_leaks

def _log_leaky(x):
    return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))


def _log_double_where(x):
    ok = x > 0
    return jnp.sum(jnp.where(ok, jnp.log(jnp.where(ok, x, 1.0)), 0.0))


def test_assert_no_leaks_fails_on_a_leak_and_names_its_line():
    with pytest.raises(AssertionError) as failure:
        assert_no_leaks(_log_leaky, jnp.ones(3))
    text = str(failure.value)
    assert "_log_leaky: 1 hazard" in text and "guarded log" in text
    assert "test_cli.py:" in text and "jnp.log(x)" in text
    assert "double where" in text


def test_assert_no_leaks_passes_on_the_double_where():
    assert_no_leaks(_log_double_where, jnp.ones(3))


def test_assert_no_leaks_checks_arguments_only_when_asked():
    def masked_product(w, data, valid):
        return jnp.sum(jnp.where(valid, w * data, 0.0))
    args = (2.0, jnp.ones(3), jnp.array([True, False, True]))
    assert_no_leaks(masked_product, *args)  # finite data: nothing leaks
    with pytest.raises(AssertionError, match="guarded mul"):
        assert_no_leaks(masked_product, *args, finite_args=False)


def test_assert_no_leaks_takes_static_arguments():
    def root(x, safe):
        inner = jnp.where(x > 0, x, 1.0) if safe else x
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(inner), 0.0))
    assert_no_leaks(root, jnp.ones(3), safe=True, static_argnames="safe")
    with pytest.raises(AssertionError):
        assert_no_leaks(root, jnp.ones(3), safe=False, static_argnames="safe")
    assert jaxsafe.testing.assert_no_leaks is assert_no_leaks
