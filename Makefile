# Two commands on a fresh machine with Python 3.11+ and make: `make demo`, `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Reinstall whenever the project's dependencies change.
INSTALLED := $(VENV)/.installed
LLAMA := $(VENV)/.llama-installed

.PHONY: demo test test-arm64 test-arm arm64-env system-deps lint typecheck unit mutation proto models clean vllm-env llama-env foreign-env

$(INSTALLED): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The distribution was called "stratus" before (a name PyPI gives an unrelated project).
	$(BIN)/python -m pip uninstall --quiet --yes stratus 2>/dev/null || true
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(INSTALLED)
	$(BIN)/stratus models verify models
	$(BIN)/stratus demo

# The integration tests whose answers depend on the precision the hardware chose run a
# second time as the other kind of CPU (AVX2-only <-> AVX-512/AMX), so that FP32 and the
# INT8/FP16 children are both served and checked on every machine.
PRECISION_TESTS := tests/integration/test_tiered_path.py tests/integration/test_clients.py \
	tests/integration/test_metrics.py tests/integration/test_batching.py \
	tests/integration/test_faults.py tests/integration/test_rollout.py

# Integration and unit tests run in two processes: gRPC's C core once crashed (a segfault in
# its event-engine thread) late in one process that had run several hundred tests' worth of
# channels and event loops; neither half alone has shown it.
test: system-deps $(INSTALLED) $(LLAMA) vllm-env foreign-env arm64-env lint typecheck
	$(BIN)/python -m pytest -q -ra tests/integration
	$(BIN)/python -m pytest -q -ra tests/unit
	STRATUS_CPU_FLAGS=$$($(BIN)/python scripts/other_cpu_flags.py) $(BIN)/python -m pytest -q -ra $(PRECISION_TESTS)

# llama.cpp (the `llama` extra) compiles from source (a C++ compiler is needed); the tests run
# it beside OpenVINO GenAI. Where it cannot build, say so and go on: its tests then fail, saying
# why (a skip is allowed only for what tests/skips.py lists).
llama-env: $(LLAMA)
$(LLAMA): $(INSTALLED)
	@if CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/python -m pip install --quiet -e '.[dev,llama,llama-server]'; then \
		touch $@; \
	else \
		echo "make: llama-cpp-python did not build here; the llama.cpp tests will fail"; \
	fi

# vLLM on CPU in an environment of its own (it pins its own torch), for the cloud tier's
# integration tests; reused while its marker matches (several minutes the first time).
vllm-env: $(INSTALLED)
	$(BIN)/python scripts/vllm_env.py

# Triton (PyTriton), MLServer and KServe as the cloud tier, each in an environment of its own
# (.venv-triton, .venv-mlserver, .venv-kserve: pinned, reused while their markers match).
# One that cannot be installed is reported; its tests then fail, saying why (no skip is allowed).
foreign-env: $(INSTALLED)
	$(BIN)/python scripts/foreign_env.py

# The system packages the tests use (promtool, a C++ compiler): apt-get as root or through
# sudo where they are missing, else one line naming what to install.
system-deps:
	@bash scripts/system_deps.sh

# ARM64 device agents, emulated: an aarch64 agent in a cached Debian arm64 chroot under QEMU
# (scripts/arm64_env.py: qemu-user-static, binfmt_misc, debootstrap, host-downloaded wheels)
# against x86 agents. `make test` and `make test-arm64` build what is missing (about 4-5 min
# cold: the chroot is cached in ~/.cache/stratus, keyed by its recipe; seconds cached) and run
# it. A failure that may pass is tried once more, then fails the run saying why; only a kernel
# where binfmt_misc cannot be mounted (exit 2) lets the test skip, saying so.
arm64-env: $(INSTALLED)
	@$(BIN)/python scripts/arm64_env.py || test $$? -eq 2

test-arm64: arm64-env
	$(BIN)/python -m pytest -q -ra -rP tests/integration/test_arm64.py

# The same, by its short name.
test-arm: test-arm64

lint: $(INSTALLED)
	$(BIN)/ruff check .

typecheck: $(INSTALLED)
	$(BIN)/mypy

# Mutation testing (mutmut) of the climb, the cascades, confidence, identities, request bounds
# and the rollout judge, each against its unit tests: a table of mutants killed and survived
# (build/mutation/table.md). Not part of `make test` (about 13 minutes on 2 cores); one small
# target runs inside it (tests/unit/test_mutation.py), so this cannot rot unnoticed.
mutation: $(INSTALLED)
	$(BIN)/python scripts/mutation.py

unit: $(INSTALLED)
	$(BIN)/python -m pytest -q tests/unit

# Regenerate the committed gRPC stubs in stratus/wire from proto/ (pinned grpcio-tools).
proto: $(INSTALLED)
	$(BIN)/python scripts/generate_stubs.py

# Rebuild the committed digits and defects models (from scikit-learn's digits and a seeded
# generator); `.venv-vllm/bin/python models/build_llm.py` rebuilds models/arith.
models: $(INSTALLED)
	$(BIN)/python -m models.build

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
