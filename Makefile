PYTHON ?= python3
VENV ?= .venv
PY = $(VENV)/bin/python
BENCH_ARGS ?=

STAMP = $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help demo test test-tables test-libs test-jax-min test-jax-newest lint fuzz bench clean package docs

help:
	@echo "Targets:"
	@echo "  make demo    build $(VENV) and run examples/quickstart.py"
	@echo "  make test    build $(VENV), run the house checks (make lint) and the test suite (not slow)"
	@echo "  make test-tables  what make test leaves out: the table sweeps in float16, bfloat16 and float64, the half of their float32 cases make test does not run, the stats functions behind a where, the longest sweeps' later cases, the tests listed in tests/long_tests.txt (CI runs both)"
	@echo "  make test-libs  install the heavy libraries (jax-md, Flax) and run their tests (CI runs it)"
	@echo "  make test-jax-min  the core and composition tests on the lowest JAX supported, in its own venv (CI runs it)"
	@echo "  make test-jax-newest  the same on the newest JAX checked (needs PYTHON312=python3.12; not in CI)"
	@echo "  make docs    run every docs example and compare its output, build the site into build/site (mkdocs, warnings are errors; CI runs it)"
	@echo "  make lint    ruff and pyright on the package"
	@echo "  make package build the sdist and the wheel, check them, install the wheel into a clean venv and run the quickstart (CI runs it)"
	@echo "  make fuzz    run the slow (property/fuzz) tests"
	@echo "  make bench   run benchmarks/run.py (BENCH_ARGS=...)"
	@echo "  make clean   remove $(VENV), build artefacts and caches"
	@echo "  make help    show this message"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

demo: $(STAMP)
	$(PY) examples/quickstart.py

# One pytest worker per CPU (pytest-xdist), one test file per worker: the suite is
# compile-bound. `make fuzz` stays in one process (it writes tests/.fuzz-counts.json).
test: lint
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder \
		-m "not slow and not libs and not tables and not long" \
		--ignore=tests/test_x64.py \
		--ignore=tests/test_x64_transparency.py --ignore=tests/test_x64_where.py \
		--ignore=tests/test_multidevice.py
	JAX_ENABLE_X64=1 $(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder \
		-m "not slow and not tables" \
		tests/test_x64.py \
		tests/test_x64_transparency.py tests/test_x64_where.py
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m pytest -n auto --dist load \
		-m "not slow" tests/test_multidevice.py

# What `make test` leaves out, marked by tests/conftest.py: the table sweeps in their other
# dtypes (float16, bfloat16; float64 with x64) and the half of their float32 cases that
# `make test` does not run (`tables`), the later cases of the longest other sweeps (`_SAMPLED`,
# also `tables`), and the tests that took 2 s or more (tests/long_tests.txt, `long`). CI runs
# both targets.
test-tables: $(STAMP)
	$(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder \
		-m "(tables or long) and not slow and not libs" \
		--ignore=tests/test_x64.py \
		--ignore=tests/test_x64_transparency.py --ignore=tests/test_x64_where.py \
		--ignore=tests/test_multidevice.py tests
	JAX_ENABLE_X64=1 $(PY) -m pytest -n auto --dist loadfile --no-loadscope-reorder \
		-m "tables and not slow" tests/test_x64.py tests/test_x64_transparency.py \
		tests/test_x64_where.py

package: $(STAMP)
	rm -rf dist
	$(PY) -m pip install -q -c constraints.txt build
	$(PY) -m build -q --outdir dist .
	$(PY) .ci/check_package.py dist
	# the wheel into a clean virtualenv, then the quickstart, run outside the source tree
	rm -rf build/clean-venv
	$(PYTHON) -m venv build/clean-venv
	build/clean-venv/bin/python -m pip install -q -c constraints.txt dist/jaxsafe-*.whl
	cd build && clean-venv/bin/python ../examples/quickstart.py > clean-venv/quickstart.txt
	grep -q "grad(nan_safe(f))(1.)         = 0.5" build/clean-venv/quickstart.txt
	cd build && clean-venv/bin/python -c "import jaxsafe; assert 'site-packages' in jaxsafe.__file__, jaxsafe.__file__"
	@echo "package: the wheel installs into a clean virtualenv and runs the quickstart"

# The lowest JAX release supported (constraints-jax-min.txt), in a virtualenv of its own: the
# core and composition tests. The newest (constraints.txt) is what make test runs on.
# The core and composition tests, run on the lowest and the newest JAX checked.
CORE_TESTS = tests/test_core.py tests/test_composition.py tests/test_api.py \
	tests/test_control_flow.py tests/test_masks.py tests/test_nn.py \
	tests/test_diagnostics.py tests/test_cli.py tests/test_by_value.py
JAX_MIN_VENV = .venv-jax-min
JAX_MIN_STAMP = $(JAX_MIN_VENV)/.installed

$(JAX_MIN_STAMP): pyproject.toml constraints-jax-min.txt
	$(PYTHON) -m venv $(JAX_MIN_VENV)
	$(JAX_MIN_VENV)/bin/python -m pip install -q --upgrade pip
	$(JAX_MIN_VENV)/bin/python -m pip install -q -c constraints-jax-min.txt -e . \
		pytest hypothesis pytest-xdist chex
	touch $@

test-jax-min: $(JAX_MIN_STAMP)
	$(JAX_MIN_VENV)/bin/python -c "import jax; assert jax.__version__ == '0.9.2', jax.__version__"
	$(JAX_MIN_VENV)/bin/python -m pytest -n auto -m "not slow" -p no:cacheprovider $(CORE_TESTS)

# The newest JAX release checked (constraints-jax-newest.txt), by hand: it needs Python >= 3.12
# (PYTHON312=...), which CI's machine does not have. The same tests as test-jax-min, less two
# that compare a gradient bit for bit with JAX on a smaller program (rows or lanes removed):
# XLA 0.12 compiles that program one ulp apart from 0.10.2 in a few lanes.
PYTHON312 ?= python3.12
JAX_NEWEST_VENV = .venv-jax-newest
JAX_NEWEST_STAMP = $(JAX_NEWEST_VENV)/.installed

$(JAX_NEWEST_STAMP): pyproject.toml constraints-jax-newest.txt
	$(PYTHON312) -m venv $(JAX_NEWEST_VENV)
	$(JAX_NEWEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(JAX_NEWEST_VENV)/bin/python -m pip install -q -c constraints-jax-newest.txt -e . \
		pytest hypothesis pytest-xdist chex
	touch $@

test-jax-newest: $(JAX_NEWEST_STAMP)
	$(JAX_NEWEST_VENV)/bin/python -c "import jax; assert jax.__version__ == '0.12.0.1', jax.__version__"
	$(JAX_NEWEST_VENV)/bin/python -m pytest -n auto -m "not slow" -p no:cacheprovider $(CORE_TESTS) \
		--deselect "tests/test_nn.py::test_gradients_of_valid_rows_equal_jax_nn_on_those_rows_alone[softmax]" \
		--deselect tests/test_by_value.py::test_nonzero_without_size_equals_the_program_with_the_dropped_lanes_removed

DOCS_STAMP = $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,docs]'
	touch $@

# The site: every public name in the generated reference with an example, the figures drawn
# by running the code, then mkdocs with warnings (broken links and anchors) as errors.
docs: $(DOCS_STAMP)
	$(PY) docs/check_examples.py
	$(PY) docs/check_reference.py
	$(PY) docs/plots.py
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

LIBS_STAMP = $(VENV)/.installed-libs

$(LIBS_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,libs]'
	touch $@

# Whole programs of heavy libraries (jax-md): their own extra, which doubles the set-up.
test-libs: $(LIBS_STAMP)
	$(PY) -m pytest -m "libs and not slow" tests/test_libraries.py tests/test_flax_attention.py

# The house checks: ruff (pyproject.toml [tool.ruff]) and pyright on jaxsafe/ ([tool.pyright]).
lint: $(STAMP)
	$(VENV)/bin/ruff check jaxsafe tests benchmarks examples docs
	$(VENV)/bin/pyright --pythonpath $(PY)

fuzz: $(STAMP)
	$(PY) -m pytest -m slow --ignore=tests/test_x64.py \
		--ignore=tests/test_x64_transparency.py --ignore=tests/test_x64_where.py
	JAX_ENABLE_X64=1 $(PY) -m pytest -m slow \
		tests/test_x64.py tests/test_x64_transparency.py tests/test_x64_where.py

BENCH_STAMP = $(VENV)/.installed-bench

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[test,bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(JAX_MIN_VENV) $(JAX_NEWEST_VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
