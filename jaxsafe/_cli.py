"""The command line: `python -m jaxsafe explain package.module:function --arg f32[8,3]`.

Prints `explain`'s report for the function at abstract arguments (zeros of each dtype and
shape). Exit status: 0 when nothing needs guarding, 1 when the rewrite changes the program, 2 on
a usage error (a missing module or function, a malformed `--arg` or `--static`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Sequence
from typing import Any

DTYPES = {"bool": "bool", "b1": "bool", "i8": "int8", "i16": "int16", "i32": "int32",
          "i64": "int64", "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
          "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
          "c64": "complex64", "c128": "complex128"}
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
    """'name=value' with a JSON value ('n=3', 'mode="sum"', 'flag=true')."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise UsageError(f"bad --static {text!r}: write name=value, the value as JSON "
                         f"(n=3, mode=\"sum\", flag=true)")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        raise UsageError(f"bad --static {text!r}: {value!r} is not JSON (a string needs "
                         f"quotes: {name}='\"{value}\"')") from None


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
    except UsageError as e:
        parser.exit(2, f"jaxsafe explain: {e}\n")
    import jax
    import jax.numpy as jnp

    from ._explain import explain
    if any(dtype.endswith("64") and dtype != "complex64" for _, dtype in shapes):
        jax.config.update("jax_enable_x64", True)  # f64[...] asked for: as the user meant it
    args = [jnp.zeros(shape, dtype) for shape, dtype in shapes]
    report = explain(fun, static_argnames=tuple(static),
                     finite_args=options.finite_args)(*args, **static)
    print(report)
    if options.diff:
        print()
        print(report.diff())
    return 1 if report.changed else 0


def run() -> None:
    """The `jaxsafe` console script."""
    sys.exit(main())
