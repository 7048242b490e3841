# `make demo` and `make test` work on a fresh clone with nothing but Python 3.11 and pip.
PYTHON ?= python3
VENV ?= .venv
VENV517 ?= .venv517
PIP_FLAGS ?= -q --disable-pip-version-check
# torch 2.13.0 is the CPU build on this machine's disk: an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: test test-newest test-517 test-slow demo test-gpu bench clean

# The two suites run side by side (one torch thread each: tests/conftest.py), each one's output printed whole.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target test-newest test-517

# xgrammar (grammar-constrained drafting) is installed without deps: its metadata pulls a
# ~1 GB triton wheel that the CPU path never uses.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install $(PIP_FLAGS) $(TORCH)
	$(VENV)/bin/pip install $(PIP_FLAGS) -e ".[test,demo]"
	$(VENV)/bin/pip install $(PIP_FLAGS) --no-deps "xgrammar>=0.2" "apache-tvm-ffi>=0.1.11"
	touch $@

# The oldest supported transformers, for the tests that touch its internals.
$(VENV517)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV517)
	$(VENV517)/bin/pip install $(PIP_FLAGS) $(TORCH) "transformers==5.17.0" accelerate safetensors pytest tqdm
	$(VENV517)/bin/pip install $(PIP_FLAGS) --no-deps -e .
	$(VENV517)/bin/pip install $(PIP_FLAGS) pydantic numpy
	$(VENV517)/bin/pip install $(PIP_FLAGS) --no-deps "xgrammar>=0.2" "apache-tvm-ffi>=0.1.11"
	touch $@

# The whole CPU suite on the newest transformers 5.x (GPU tests skip without CUDA; the long ones: test-slow).
test-newest: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests -q -m "not slow"

# Long CPU runs (the larger rollback fuzz, the second sampling-distribution paths).
test-slow: $(VENV)/.installed
	$(VENV)/bin/python -m pytest tests -q -m slow

# Tests that touch transformers internals, again on transformers 5.17.0.
test-517: $(VENV517)/.installed
	$(VENV517)/bin/python -m pytest tests -q -m "tf_internals and not slow"

demo: $(VENV)/.installed
	$(VENV)/bin/python -m dsv4_mtp_hf.demo

# On a CUDA machine, with the package importable (the device: PYTHONPATH=src): the GPU tests only.
test-gpu:
	$(PYTHON) -m pytest tests -q -m gpu

# On a CUDA machine: the FP4 MoE op, the draft step, the target's decode step with packed experts, the
# sampled round's warps and generate end to end; each prints its table last.
OUT ?= .
bench:
	$(PYTHON) benchmarks/moe_op.py --out $(OUT)
	$(PYTHON) benchmarks/draft_step.py --out $(OUT)
	$(PYTHON) benchmarks/target_step.py --out $(OUT)
	$(PYTHON) benchmarks/sampling_warp.py --out $(OUT)
	$(PYTHON) benchmarks/e2e_generate.py --out $(OUT)
	$(PYTHON) benchmarks/e2e_generate.py --fp4-experts --graph-target --layers 2,5 --batches "" --out $(OUT)/fast

clean:
	rm -rf $(VENV) $(VENV517) build *.egg-info src/*.egg-info
