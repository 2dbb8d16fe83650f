"""Run every ```python block of the docs and compare its output with the ```text block after it.

    .venv/bin/python docs/check_examples.py            # check (exit status 1 on a mismatch)
    .venv/bin/python docs/check_examples.py --update   # rewrite the ```text blocks in place

Each ```python block runs on its own, in a fresh interpreter, as a file named `example.py` in a
directory of its own (so that `jaxsafe.explain` prints `example.py:LINE:COL` and quotes the
line). A block followed by a ```text block must print exactly that text; a block without one
must print nothing. Blocks in other languages are not run.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = ["README.md", "docs/index.md", "docs/how-it-works.md", "docs/api.md", "docs/nn.md",
         "docs/diagnostics.md", "docs/getting-started.md", "docs/composition.md",
         "docs/scale.md", "docs/faq.md"]
BLOCK = re.compile(r"```python\n(.*?)```\n(\n*```text\n(.*?)```\n)?", re.S)
RUNNER = ("src = open('example.py').read(); "
          "exec(compile(src, 'example.py', 'exec'), {'__name__': '__main__'})")


def run(code: str) -> str:
    """Run `code` as `example.py` in a directory of its own, where the diagnostics can read the
    lines they quote."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as where:
        (pathlib.Path(where) / "example.py").write_text(code)
        proc = subprocess.run([sys.executable, "-c", RUNNER], text=True,
                              capture_output=True, cwd=where, env=env)
    if proc.returncode:
        raise RuntimeError(f"example failed:\n{code}\n{proc.stderr}")
    return proc.stdout


def main(update: bool) -> int:
    failures = 0
    present = [name for name in FILES if (ROOT / name).exists()]
    for name in FILES:
        if name not in present:
            print(f"{name}: missing")
            failures += 1
    texts = {name: (ROOT / name).read_text() for name in present}
    blocks_of = {name: list(BLOCK.finditer(texts[name])) for name in present}
    # every block of every page in one pool: each block is its own process
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        runs = {name: [pool.submit(run, m.group(1)) for m in blocks_of[name]]
                for name in present}
        outputs_of = {name: [r.result() for r in runs[name]] for name in present}
    for name in present:
        path, text = ROOT / name, texts[name]
        pieces, last = [], 0
        blocks, outputs = blocks_of[name], outputs_of[name]
        for m, actual in zip(blocks, outputs, strict=True):
            code, expected = m.group(1), m.group(3)
            if expected is None:
                if actual:
                    print(f"{name}: a block without a ```text block printed:\n{actual}")
                    failures += 1
                continue
            if actual != expected:
                if update:
                    start, end = m.span(3)
                    pieces.append(text[last:start] + actual)
                    last = end
                else:
                    print(f"{name}: output differs for\n{code}\n--- expected\n{expected}"
                          f"--- actual\n{actual}")
                    failures += 1
        if update and pieces:
            path.write_text("".join(pieces) + text[last:])
            print(f"updated {name}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main("--update" in sys.argv[1:]))
