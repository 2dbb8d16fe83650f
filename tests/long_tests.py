"""Write `tests/long_tests.txt`, the tests `make test` leaves to `make test-tables`, from a
`--junitxml` report of `make test`'s main session.

A test is long when it took `--seconds` or more. Kept in `make test` whatever their time: the
quickest case of each parametrized test (its mechanism stays in the fast loop) and the first
test a worker ran of each module (its time holds the module's fixtures: transparency's and the
drop table's programs are built there).

    python tests/long_tests.py report.xml [--seconds 1.5] > tests/long_tests.txt

A stale list costs time, never a test: a listed test runs in `make test-tables` (CI runs
both), an unlisted one in `make test`; conftest fails if the list names a test that does not
exist.
"""

import argparse
import re
import sys
import xml.etree.ElementTree as ET

HEADER = """\
# The tests `make test` leaves to `make test-tables` (CI runs both): those that took 1.5 s or
# more in `make test`'s main session, less the quickest case of each parametrized test and the
# first test of each module. Written by tests/long_tests.py from a --junitxml report; read by
# tests/conftest.py, which marks them `long`.
"""


def long_tests(report: str, seconds: float) -> list[str]:
    first_of_module: set[str] = set()
    openers: set[tuple[str, str]] = set()
    tests: dict[tuple[str, str], list[tuple[float, str]]] = {}
    for case in ET.parse(report).iter("testcase"):
        module, name = case.get("classname", ""), case.get("name", "")
        path = "tests/" + module.split(".")[-1] + ".py"
        if path not in first_of_module:
            first_of_module.add(path)
            openers.add((path, name))
        tests.setdefault((path, re.sub(r"\[.*", "", name)), []).append(
            (float(case.get("time", 0)), name))
    found = []
    for (path, _), cases in tests.items():
        quickest = min(cases)[1] if "[" in cases[0][1] else None
        found += [f"{path}::{name}" for time, name in cases
                  if time >= seconds and name != quickest and (path, name) not in openers]
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a --junitxml report of make test's main session")
    parser.add_argument("--seconds", type=float, default=1.5, help="the shortest long test")
    args = parser.parse_args()
    sys.stdout.write(HEADER + "".join(t + "\n" for t in long_tests(args.report, args.seconds)))


if __name__ == "__main__":
    main()
