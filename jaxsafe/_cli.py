"""The command line: `python -m jaxsafe explain package.module:function --arg f32[8,3]`.

Prints `explain`'s report for the function at abstract arguments (zeros of each dtype and
shape). Exit status: 0 when nothing needs guarding, 1 when the rewrite changes the program, 2 on
a usage error (a missing module or function, a malformed `--arg` or `--static`, arguments the
function does not take).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

DTYPES = {"bool": "bool", "b1": "bool", "i8": "int8", "i16": "int16", "i32": "int32",
          "i64": "int64", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
          "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
          "c64": "complex64", "c128": "complex128"}
X64_DTYPES = {"int64", "uint64", "float64", "complex128"}
"""The dtypes that need `jax_enable_x64` (without it JAX truncates them to 32 bits)."""
ARG = re.compile(r"^\s*([a-z0-9]+)\s*\[\s*([0-9,\s]*)\]\s*$")


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit status 2."""


def parse_arg(text: str) -> tuple[tuple[int, ...], str]:
    """'f32[8,3]' -> ((8, 3), 'float32'); 'i32[]' -> ((), 'int32')."""
    m = ARG.match(text)
    if m is None or m.group(1) not in DTYPES and m.group(1) not in DTYPES.values():
        raise UsageError(f"bad --arg {text!r}: write dtype[shape], e.g. f32[8,3] or i32[] "
                         f"(dtypes: {', '.join(DTYPES)})")
    inside = m.group(2).strip()
    dims = [d.strip() for d in inside.split(",")] if inside else []
    if dims and dims[-1] == "":  # a trailing comma, as Python writes (8,)
        dims.pop()
    if any(d == "" for d in dims):
        raise UsageError(f"bad --arg {text!r}: the shape is a list of sizes, e.g. [8,3]")
    return tuple(int(d) for d in dims), DTYPES.get(m.group(1), m.group(1))


def parse_static(text: str) -> tuple[str, Any]:
    """'name=value' with a JSON value ('n=3', 'mode="sum"', 'flag=true', 'axis=[0,1]'); a
    JSON array is read as a tuple, as a static argument must be hashable."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise UsageError(f"bad --static {text!r}: write name=value, the value as JSON "
                         f"(n=3, mode=\"sum\", flag=true, axis=[0,1])")
    try:
        parsed = _tuples(json.loads(value))
    except json.JSONDecodeError:
        raise UsageError(f"bad --static {text!r}: {value!r} is not JSON (a string needs "
                         f"quotes: {name}='\"{value}\"')") from None
    try:
        hash(parsed)
    except TypeError:
        raise UsageError(f"bad --static {text!r}: a static value must be hashable, and a "
                         f"JSON object is not; pass a number, a string, true, false, null or "
                         f"an array (read as a tuple)") from None
    return name, parsed


def _tuples(value: Any) -> Any:
    """`value` with every JSON array (nested ones too) a tuple; without recursion: the
    innermost arrays first, each array once."""
    if not isinstance(value, list):
        return value
    arrays, stack = [], [value]
    while stack:  # parents before their children
        array = stack.pop()
        arrays.append(array)
        stack.extend(x for x in array if isinstance(x, list))
    done: dict[int, tuple] = {}
    for array in reversed(arrays):  # children before their parents
        done[id(array)] = tuple(done[id(x)] if isinstance(x, list) else x for x in array)
    return done[id(value)]


def check_call(fun: Any, n_args: int, static: dict[str, Any]) -> None:
    """A usage error when `fun` cannot take `n_args` positional arguments and `static` (a
    signature that cannot be read takes anything: the call then says)."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*range(n_args), **static)
    except TypeError as e:
        raise UsageError(f"{getattr(fun, '__name__', 'the function')}{signature} does not take "
                         f"the arguments given ({n_args} --arg, --static "
                         f"{', '.join(static) or 'none'}): {e}. Give one --arg per positional "
                         f"argument, in order, and --static name=JSON for the others") from None


def load(target: str) -> Any:
    """'package.module:function' (or 'module:Class.method') -> the function."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"bad target {target!r}: write package.module:function")
    if "" not in sys.path and "." not in sys.path:  # the console script: the working dir too
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise UsageError(f"no module named {e.name!r} (run from the directory that holds "
                             f"it, or install its package)") from None
        raise
    fun: Any = module
    for part in attr.split("."):
        if not hasattr(fun, part):
            raise UsageError(f"module {module_name!r} has no {attr!r}")
        fun = getattr(fun, part)
    if not callable(fun):
        raise UsageError(f"{target} is a {type(fun).__name__}, not a function")
    return fun


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxsafe", description="What jaxsafe.nan_safe guards in a function, and why.")
    commands = parser.add_subparsers(dest="command", required=True)
    ex = commands.add_parser(
        "explain", help="print the report of a function at abstract arguments",
        description="Print jaxsafe.explain's report. Exit status: 0 nothing to guard, "
                    "1 guards inserted, 2 usage error.")
    ex.add_argument("target", help="package.module:function")
    ex.add_argument("--arg", action="append", default=[], metavar="DTYPE[SHAPE]",
                    help="a positional argument, e.g. f32[8,3] or i32[] (repeat, in order)")
    ex.add_argument("--static", action="append", default=[], metavar="NAME=JSON",
                    help="a static keyword argument, its value as JSON (repeatable)")
    ex.add_argument("--finite-args", action="store_true",
                    help="take the arguments as finite (no NaN or inf in them)")
    ex.add_argument("--diff", action="store_true",
                    help="also print the unified diff of the original and rewritten jaxprs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    options = parser.parse_args(argv)  # exits with status 2 on its own usage errors
    try:
        shapes = [parse_arg(a) for a in options.arg]
        static = dict(parse_static(s) for s in options.static)
        fun = load(options.target)
        check_call(fun, len(shapes), static)
    except UsageError as e:
        parser.exit(2, f"jaxsafe explain: {e}\n")
    import jax
    import jax.numpy as jnp

    from ._explain import explain
    if any(dtype in X64_DTYPES for _, dtype in shapes):
        jax.config.update("jax_enable_x64", True)  # f64[...] asked for: as the user meant it
    args = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
    try:
        report = explain(fun, static_argnames=tuple(static),
                         finite_args=options.finite_args)(*args, **static)
    except Exception:  # noqa: BLE001  (the function's own error, at the arguments given)
        # not status 1, which says "the program changed": the traceback, then a usage error
        traceback.print_exc()
        parser.exit(2, f"jaxsafe explain: {options.target} failed at the arguments given "
                       "(the traceback above); check --arg and --static against it\n")
    print(report)
    if options.diff:
        print()
        print(report.diff())
    return 1 if report.changed else 0


def run() -> None:
    """The `jaxsafe` console script."""
    sys.exit(main())
