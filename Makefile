# make run   execute the whole lesson on a local 4-engine MPI cluster; HTML in build/html/
# make test  the whole test suite (unit, MPI, notebooks); leaves no process running
# make lab   JupyterLab with a 4-engine MPI cluster
# make torch  the optional torch extra (PyTorch's CPU build) for the PyTorch bridge
# make student  student copies of the notebooks, solutions replaced by stubs, in build/student/
# make grade SUBMISSIONS=dir  (root) grade a class's answers, each in a sandbox: build/grades/DIR/
# make hosts  simulated hosts (no root: a user namespace, private to this checkout), HOSTS=2 x
#             SLOTS=2 on a BANDWIDTH=1gbit link; then
#             build/hosts/mpiexec -n 4 python -m fsdp_lesson train ...  (make hosts-down)
# Each creates .venv and installs the project into it when missing (needs only python3 and make).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test lab torch student grade hosts hosts-down clean

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

torch: $(VENV)/installed
	$(PY) tools/install_torch.py

student: $(VENV)/installed
	$(PY) tools/student.py

# OUT=folder for this class's grades (default build/grades/<SUBMISSIONS' name>), REPLACE=1 to
# replace the grades already there, TIMEOUT=seconds per notebook (default 900)
grade: $(VENV)/installed
	@test -n "$(SUBMISSIONS)" || { echo "usage: make grade SUBMISSIONS=folder [OUT=folder] [REPLACE=1] [TIMEOUT=900]" >&2; exit 2; }
	$(PY) tools/grade.py "$(SUBMISSIONS)" $(if $(OUT),--out "$(OUT)") $(if $(REPLACE),--replace) $(if $(TIMEOUT),--timeout $(TIMEOUT))

HOSTS ?= 2
SLOTS ?= 2
BANDWIDTH ?= 1gbit
hosts: $(VENV)/installed
	$(PY) -m fsdp_lesson hosts up --hosts $(HOSTS) --slots $(SLOTS) --bandwidth $(BANDWIDTH)

hosts-down: $(VENV)/installed
	$(PY) -m fsdp_lesson hosts down

clean:
	rm -rf build .pytest_cache
