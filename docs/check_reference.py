"""`make docs` fails when a public name has no entry in docs/reference.md or no example in its
docstring: the generated reference documents every public name, with an example each."""

import pathlib
import sys

import jaxsafe
import jaxsafe.nn
import jaxsafe.testing

REFERENCE = pathlib.Path(__file__).resolve().parent / "reference.md"


def public() -> dict[str, object]:
    names = {f"jaxsafe.{n}": getattr(jaxsafe, n) for n in jaxsafe.__all__
             if n not in ("nn", "testing")}
    names.update({f"jaxsafe.nn.{n}": getattr(jaxsafe.nn, n)
                  for n in ("softmax", "log_softmax", "logsumexp", "dot_product_attention")})
    names.update({f"jaxsafe.testing.{n}": getattr(jaxsafe.testing, n)
                  for n in jaxsafe.testing.__all__})
    return names


def main() -> int:
    text = REFERENCE.read_text()
    problems = [f"{name}: no `::: {name}` in docs/reference.md" for name in public()
                if f"::: {name}\n" not in text]
    problems += [f"{name}: its docstring has no Example section" for name, obj in public().items()
                 if callable(obj) and "Example" not in (obj.__doc__ or "")]
    for p in problems:
        print("docs:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
