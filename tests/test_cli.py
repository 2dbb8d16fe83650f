"""The command line (`python -m jaxsafe explain`, the `jaxsafe` script) and
`jaxsafe.testing.assert_no_leaks` (issue 16)."""

import pathlib
import subprocess
import sys
import textwrap

import jax
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


    def total(x, axis=0):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0), axis=axis)


    SEEN = []


    def phase(z):
        SEEN.append(z.dtype)
        return jnp.sum(jnp.where(z.real > 0, jnp.log(z), 0.0))


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
    # hunt BC 5: these crashed with a traceback and exit status 1 ("the program changes")
    (["explain", "user_model:root"], "root(x, scale=1.0) does not take the arguments given "
                                     "(0 --arg, --static none): missing a required argument"),
    (["explain", "user_model:root", "--arg", "f32[]", "--arg", "f32[]", "--arg", "f32[]"],
     "too many positional arguments. Give one --arg per positional argument"),
    (["explain", "user_model:root", "--arg", "f32[]", "--static", "size=2"],
     "unexpected keyword argument 'size'"),
    (["explain", "user_model:root", "--arg", "f32[]", "--static", 'scale={"a": 1}'],
     "a static value must be hashable, and a JSON object is not"),
])
def test_usage_errors_exit_2_with_a_message(user_module, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        _cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_a_json_array_static_is_a_tuple(user_module, capsys):
    """Hunt BC 5: `axis=[0,1]` reached jax.jit as an unhashable list (a traceback, exit 1)."""
    assert _cli.parse_static("axes=[[0], [1, [2]], 3]") == ("axes", ((0,), (1, (2,)), 3))
    assert _cli.parse_static("axis=[]") == ("axis", ())
    assert _cli.main(["explain", "user_model:total", "--arg", "f32[3,4]",
                      "--static", "axis=[0, 1]"]) == 1
    import user_model  # the fixture's module, which main imported
    want = jaxsafe.explain(user_model.total, static_argnames="axis")(
        jnp.zeros((3, 4)), axis=(0, 1))
    assert capsys.readouterr().out == f"{want}\n"


@pytest.mark.parametrize("arg, dtype", [("c128[2]", "complex128"), ("complex128[2]", "complex128"),
                                        ("f64[2]", "float64"), ("i64[]", "int64"),
                                        ("u64[3]", "uint64"), ("c64[2]", "complex64")])
def test_a_64_bit_dtype_turns_on_x64(user_module, arg, dtype):
    """Hunt BC 4: c128 did not turn x64 on (it does not end in "64"): explained at complex64."""
    before = jax.config.jax_enable_x64
    try:
        _cli.main(["explain", "user_model:phase", "--arg", arg])
        x64 = jax.config.jax_enable_x64
    finally:
        jax.config.update("jax_enable_x64", before)
    import user_model
    assert [str(d) for d in user_model.SEEN] == [dtype]
    assert x64 == (before or dtype != "complex64")


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


def test_a_function_that_fails_at_the_arguments_given_exits_2(user_module, capsys):
    """Hunt BC 5's follow-up: the function's own error at the given arguments (a matrix
    product of mismatched shapes) exited 1, the status of "the program changes"."""
    user_module.write_text(user_module.read_text() + "\n\ndef gram(x):\n    return x @ x\n")
    with pytest.raises(SystemExit) as exit_:
        _cli.main(["explain", "user_model:gram", "--arg", "f32[2,3]"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "user_model:gram failed at the arguments given" in err and "TypeError" in err
