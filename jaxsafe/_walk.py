"""Evaluating a value from the equations that produce it, without recursion.

Static passes ask for one value at a time (a predicate's constant, an operand's lower bound) and
need its producers' values first. Chains in real programs are thousands of equations deep, past
Python's recursion limit, so the walk keeps its own stack; results are memoized per pass.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any


def postorder(atom: Hashable, memo: dict, children: Callable[[Any], Iterable[Any]],
              evaluate: Callable[[Any], Any]) -> Any:
    """`memo[atom]`, computing `evaluate(v)` for `atom` and, first, for every `children(v)` not
    yet in `memo` (the variables `v` is computed from; none for a leaf)."""
    stack = [atom]
    while stack:
        v = stack[-1]
        if v in memo:
            stack.pop()
            continue
        todo = [u for u in children(v) if u not in memo]
        if todo:
            stack.extend(todo)
            continue
        stack.pop()
        memo[v] = evaluate(v)
    return memo[atom]
