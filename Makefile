# The README's commands. `.venv` is created with python3.12 on first use.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed-stamp
AOT_STAMP := .venv/libtpu-aot/.installed-stamp

.PHONY: demo test aot mutate bench lint clean-venv

# pip's output goes to .venv/install.log, shown only if the install fails.
$(VENV_STAMP): pyproject.toml
	@test -x $(PY) || python3.12 -m venv .venv
	@echo "installing the project into .venv (log: .venv/install.log)"
	@( $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[test,wandb,lint,eval]" ) \
	  > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
	@touch $(VENV_STAMP)

# libtpu, for compiling TPU programs ahead of time on this host (scripts/aot_compile.py): the version
# jax[tpu] pins, installed beside the environment, not into it (lmcore/tpu_slices.py says why).
LIBTPU_PIN = $(PY) -c 'from importlib.metadata import requires; print(next(r.split(";")[0] for r in requires("jax") if r.startswith("libtpu")))'
$(AOT_STAMP): $(VENV_STAMP)
	@echo "installing libtpu into .venv/libtpu-aot (log: .venv/install.log)"
	@$(PY) -m pip install -q --no-deps --upgrade --target .venv/libtpu-aot "$$($(LIBTPU_PIN))" \
	  > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
	@touch $(AOT_STAMP)

aot: $(AOT_STAMP)

demo: $(VENV_STAMP)
	$(PY) scripts/quickstart.py --workdir=runs/quickstart

# Two workers: the CI machine has 2 cores (about 13 min there; conftest.py starts the slow tests first).
test: $(VENV_STAMP) $(AOT_STAMP)
	$(PY) -m pytest -n 2 tests

# Curated one-line faults (tests/mutants.toml), each run with the test that must fail on it; not in CI.
mutate: $(VENV_STAMP)
	$(PY) scripts/mutate.py

bench: $(VENV_STAMP)
	$(PY) scripts/bench_kernels.py

# Pyflakes and syntax errors (pyproject.toml [tool.ruff]).
lint: $(VENV_STAMP)
	$(PY) -m ruff check .

clean-venv:
	rm -rf .venv
