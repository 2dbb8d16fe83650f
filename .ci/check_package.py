"""Check what `make package` built: the wheel and the sdist hold the package, its typing
marker and its license, no tests or benchmarks, and the version jaxsafe reports."""

import pathlib
import sys
import tarfile
import zipfile

DIST = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "dist")


def version() -> str:
    init = pathlib.Path(__file__).resolve().parent.parent / "jaxsafe" / "__init__.py"
    for line in init.read_text().splitlines():
        if line.startswith("__version__"):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit("no __version__ in jaxsafe/__init__.py")


def main() -> int:
    v = version()
    wheels = sorted(DIST.glob(f"jaxsafe-{v}-*.whl"))
    sdists = sorted(DIST.glob(f"jaxsafe-{v}.tar.gz"))
    problems = []
    if len(wheels) != 1 or len(sdists) != 1:
        raise SystemExit(f"expected one wheel and one sdist of {v} in {DIST}, found "
                         f"{[p.name for p in DIST.iterdir()]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(f"jaxsafe-{v}.dist-info/METADATA").decode()
    if "jaxsafe/py.typed" not in names:
        problems.append("the wheel has no jaxsafe/py.typed")
    if not any(n.endswith("/licenses/LICENSE") for n in names):
        problems.append("the wheel has no LICENSE")
    problems += [f"the wheel ships {n}" for n in names
                 if n.split("/")[0] in ("tests", "benchmarks", "examples", "docs")]
    if "License-Expression: Apache-2.0" not in metadata:
        problems.append("the wheel's METADATA names no license")
    if "absl" in metadata:
        problems.append("the wheel still requires absl-py")
    with tarfile.open(sdists[0]) as sdist:
        members = sdist.getnames()
    root = f"jaxsafe-{v}/"
    problems += [f"the sdist ships {m}" for m in members
                 if m.startswith(root + "tests/") or m.startswith(root + "benchmarks/")]
    if root + "LICENSE" not in members:
        problems.append("the sdist has no LICENSE")
    for p in problems:
        print("package:", p)
    if not problems:
        print(f"package: {wheels[0].name} and {sdists[0].name} are complete")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
