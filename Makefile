# make run   execute the whole lesson on a local 4-engine MPI cluster; HTML in build/html/
# make test  the whole test suite (unit, MPI, notebooks); leaves no process running
# make lab   JupyterLab with a 4-engine MPI cluster
# Each creates .venv and installs the project into it when missing (needs only python3 and make).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test lab clean

$(VENV)/installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[data,dev]"
	touch $@

run: $(VENV)/installed
	$(PY) tools/lesson.py run

test: $(VENV)/installed
	$(PY) tools/lesson.py test

lab: $(VENV)/installed
	$(PY) tools/lesson.py lab

clean:
	rm -rf build .pytest_cache
