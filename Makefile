# The README's commands. `.venv` is created with python3.12 on first use.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed-stamp

.PHONY: demo test mutate bench lint clean-venv

# pip's output goes to .venv/install.log, shown only if the install fails.
$(VENV_STAMP): pyproject.toml
	@test -x $(PY) || python3.12 -m venv .venv
	@echo "installing the project into .venv (log: .venv/install.log)"
	@( $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e ".[test,wandb,lint,tpu,eval]" ) \
	  > .venv/install.log 2>&1 || { cat .venv/install.log; exit 1; }
	@touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) scripts/quickstart.py --workdir=runs/quickstart

# Two workers: the CI machine has 2 cores (about 13 min there; conftest.py starts the slow tests first).
test: $(VENV_STAMP)
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
