"""Computing a value from the values it depends on, without recursion.

The static passes ask for one value at a time (a predicate's constant, an operand's lower bound,
what a value holds in its dropped lanes) and need some of its producers' values first. Written
recursively, that is a call per equation of the chain, and chains in real programs are thousands
of equations deep (an unrolled integrator), past Python's recursion limit. So each rule is a
generator that *yields* the key of every value it needs and receives that value back; `demand`
runs the generators on a stack of its own and memoizes every result. A rule asks only for what
it needs, in order, so it can stop at the first operand that settles the answer.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")

Rule = Callable[[Any], Generator[Hashable, T, T]]
"""(key) -> a generator that yields the keys it needs, receives their values, returns its own."""


def demand(key: Hashable, memo: MutableMapping[Any, T], rule: Rule) -> T:
    """`memo[key]`, computing it with `rule` (and, first, whatever it asks for) if missing."""
    if key in memo:
        return memo[key]
    stack = [(key, rule(key))]
    active = {key}  # a program is acyclic: asking for a key under way is a bug
    sent: Any = None
    while stack:
        current, gen = stack[-1]
        try:
            need = gen.send(sent)
        except StopIteration as done:
            memo[current] = done.value
            stack.pop()
            active.discard(current)
            sent = done.value
            continue
        if need in memo:
            sent = memo[need]
        else:
            assert need not in active, f"cycle through {need!r}"
            stack.append((need, rule(need)))
            active.add(need)
            sent = None
    return memo[key]
