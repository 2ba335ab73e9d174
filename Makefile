# make run   execute the whole lesson on a local 4-engine MPI cluster; HTML in build/html/
# make test  the whole test suite (unit, MPI, notebooks); leaves no process running
# make lab   JupyterLab with a 4-engine MPI cluster
# make student  student copies of the notebooks, solutions replaced by stubs, in build/student/
# make grade SUBMISSIONS=dir  run a class's notebooks, grade their exercises: build/grades.csv, .md
# Each creates .venv and installs the project into it when missing (needs only python3 and make).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test lab student grade clean

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

student: $(VENV)/installed
	$(PY) tools/student.py

# TIMEOUT=seconds per notebook (default 900)
grade: $(VENV)/installed
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder [TIMEOUT=900]" >&2; exit 2; }
	$(PY) tools/grade.py "$(SUBMISSIONS)" $(if $(TIMEOUT),--timeout $(TIMEOUT))

clean:
	rm -rf build .pytest_cache
