# The README's two commands. Each installs what is missing first, so both work on a fresh machine:
#   make demo   - the main job: base policy + asynchronous REINFORCE Zero on the tool task
#   make test   - lint and the whole test suite (what .ci/run runs)
# torch is pinned (torch==2.13.0, whose CPU build these machines find locally; an unpinned `torch` would
# pull a multi-GB CUDA build); TORCH_ARGS passes pip options with it, e.g. an --index-url.
# Extra arguments go through ARGS, e.g. `make demo ARGS="--steps 20"`, `make test ARGS="-x tests/rl"`.
# The tests run in JOBS pytest-xdist workers (2: the machine's cores; much of the suite waits on
# subprocesses, Ray and sandboxes), each test file on one worker in its order, the longest files first,
# each worker on its share of the cores (tests/conftest.py; how long it takes: the README); JOBS=0 runs
# them all in one.

PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_ARGS ?=
JOBS ?= 2
PIP = PIP_ROOT_USER_ACTION=ignore $(PYTHON) -m pip install -q --disable-pip-version-check
HAVE = $(PYTHON) -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))'

.PHONY: demo test install install-dev

demo: install
	$(PYTHON) -m parity.cli demo $(ARGS)

test: install-dev
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -n $(JOBS) --dist loadfile $(ARGS)

install:
	@$(HAVE) torch || { echo "installing $(TORCH) (CPU build)"; $(PIP) "$(TORCH)" $(TORCH_ARGS); }
	@$(PYTHON) -m pip show -q parity >/dev/null 2>&1 && $(HAVE) safetensors tokenizers jinja2 rich matplotlib \
		|| { echo "installing parity and its dependencies"; $(PIP) -e .; }

install-dev: install
	@$(HAVE) pytest xdist hypothesis ruff transformers ray triton || { echo "installing the test extras"; $(PIP) -e ".[dev]"; }
