# make quickstart  SFT warm-up, GRPO, then held-out accuracy of the SFT and the RL model (2-core CPU: ~5-9 min with bf16, ~13-17 without, set-up included)
# make test       set up .venv on a fresh machine (CPU torch first), the Debian packages tests use, and run the suite
# make rollout    run the small CPU rollout recipe with SmolLM2-135M-Instruct
# make bench      run the benchmarks in bench/ (vs_trl.py sets up TRL in .venv-trl on first use)
# make gpu-wheels what bench/gpu_colocated.py needs carried to a GPU machine without network (build/)
# make test-sglang  the real-SGLang tests on CPU, in a separate SGLang environment (~10 min, ~6 GB
#                   to set up the first time, cached in $(AGENTRL_CACHE)/sglang-venv)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system-packages runtime-packages test quickstart rollout bench clean sglang-setup test-sglang gpu-wheels

# Debian packages. For every CPU run: tcmalloc (agentrl/allocator.py: about 1.5x on a training
# step). For the tests too: headless Chromium for the trajectory viewer, bubblewrap for the python
# tool's sandbox, strace to see what training ranks and Ray send, iproute2 to bring up loopback in a
# network namespace of a test's own (the TCP rendezvous's, where no name server can be asked).
RUNTIME_PACKAGES := libtcmalloc-minimal4
SYSTEM_PACKAGES := $(RUNTIME_PACKAGES) chromium chromium-driver bubblewrap strace iproute2

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch must come first, or pip resolves a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Installs what is missing (needs root or sudo); without them agentrl still runs (on the system
# allocator) and the tests that need them skip and say so.
define install_missing
	@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing $$missing"; \
		($$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null) \
			|| echo "warning: could not install $$missing"; \
	fi
endef

system-packages:
	$(call install_missing,$(SYSTEM_PACKAGES))

runtime-packages:
	$(call install_missing,$(RUNTIME_PACKAGES))

test: setup system-packages
	$(PY) -m agentrl.models smollm2-135m-instruct
	$(PY) -m pytest -q -rs tests

QUICKSTART := recipes/quickstart.yaml
quickstart: setup runtime-packages
	$(PY) -m agentrl.models smollm2-135m-instruct
	$(VENV)/bin/agentrl sft $(QUICKSTART)
	$(VENV)/bin/agentrl train $(QUICKSTART)
	$(VENV)/bin/agentrl eval $(QUICKSTART) model.path=runs/quickstart/sft
	$(VENV)/bin/agentrl eval $(QUICKSTART) model.path=runs/quickstart/final

rollout: setup runtime-packages
	$(VENV)/bin/agentrl rollout recipes/rollout_cpu.yaml

bench: setup runtime-packages
	$(PY) bench/rollout_efficiency.py
	$(PY) bench/mixed_pass.py
	$(PY) bench/decode_step.py
	$(PY) bench/sampling.py
	$(PY) bench/packed_update.py
	$(PY) bench/vs_trl.py
	$(PY) bench/fsdp_overhead.py
	$(PY) bench/weight_sync.py

# What bench/gpu_colocated.py needs on a GPU machine that has torch and transformers and no network:
# the wheels of the packages agentrl imports there that such an image lacks (Python 3.12, the
# versions of .venv), torch-memory-saver, and the SmolLM2 tokenizer; about 9 MB to carry.
GPU_PYTHON ?= 3.12
GPU_PACKAGES := pydantic pydantic_core annotated-types typing-inspection jsonschema jsonschema-specifications \
	referencing rpds-py
gpu-wheels: setup
	rm -rf build/gpu-wheels build/gpu-tokenizer
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-d build/gpu-wheels torch-memory-saver==0.0.10 \
		$$(for p in $(GPU_PACKAGES); do echo "$$p==$$($(PY) -c "import importlib.metadata as m; print(m.version('$$p'))")"; done)
	$(PY) -c "from agentrl.models import load_tokenizer; load_tokenizer('smollm2-135m-instruct', chat_template='hermes').save_pretrained('build/gpu-tokenizer')"

# SGLang's CPU backend: its source tree and CPU kernel wheel (see README, "SGLang engine").
SGLANG_CPU ?= ../shared/sglang-cpu
SGLANG_COMMIT := 44806dc
AGENTRL_CACHE ?= $(HOME)/.cache/agentrl
SGLANG_VENV ?= $(AGENTRL_CACHE)/sglang-venv
SGLANG_PY := $(SGLANG_VENV)/bin/python
SGLANG_STAMP := $(SGLANG_VENV)/.installed-$(SGLANG_COMMIT)

$(SGLANG_STAMP):
	test -f $(SGLANG_CPU)/sglang-python-$(SGLANG_COMMIT).tar.gz || \
		{ echo "no SGLang source in $(SGLANG_CPU); set SGLANG_CPU=DIR"; exit 2; }
	rm -rf $(SGLANG_VENV)
	python3.11 -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	# PyPI's torch (the CUDA build; it runs on CPU), because the CPU-only torch has no matching
	# torchvision. --isolated skips user pip settings (find-links) that may offer a +cpu build.
	$(SGLANG_PY) -m pip install --quiet --isolated torch==2.13.0 torchvision==0.28.0
	# SGLang's CPU requirements with triton relaxed to what torch 2.13.0 needs.
	sed 's/^triton==.*/triton==3.7.1/' $(SGLANG_CPU)/requirements.txt > $(SGLANG_VENV)/requirements.txt
	$(SGLANG_PY) -m pip install --quiet -r $(SGLANG_VENV)/requirements.txt
	$(SGLANG_PY) -m pip install --quiet --no-deps timm==1.0.16
	$(SGLANG_PY) -m pip install --quiet --no-deps $(SGLANG_CPU)/sglang_kernel_cpu-*.whl
	$(SGLANG_PY) -m pip install --quiet "setuptools>=61" "setuptools-scm>=8" wheel
	mkdir -p $(SGLANG_VENV)/src
	tar xzf $(SGLANG_CPU)/sglang-python-$(SGLANG_COMMIT).tar.gz -C $(SGLANG_VENV)/src
	cp $(SGLANG_VENV)/src/python/pyproject_cpu.toml $(SGLANG_VENV)/src/python/pyproject.toml
	cd $(SGLANG_VENV)/src/python && SETUPTOOLS_SCM_PRETEND_VERSION=0.0.0.dev0+g$(SGLANG_COMMIT) \
		$(SGLANG_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(SGLANG_STAMP)

sglang-setup: $(SGLANG_STAMP)

# One test file at a time: each starts SGLang's scheduler processes.
SGLANG_TESTS := $(wildcard tests/real_sglang/test_*.py)
test-sglang: sglang-setup
	# agentrl and its dependencies (torch and transformers are SGLang's); the environment is shared
	# between checkouts, so it points at this one.
	$(SGLANG_PY) -m pip install --quiet -e ".[dev]"
	$(SGLANG_PY) -m agentrl.models smollm2-135m-instruct
	rm -f runs/test-sglang/figures.json
	set -e; for t in $(SGLANG_TESTS); do \
		SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -m pytest -q -rs -m sglang $$t; done
	cat runs/test-sglang/figures.json

clean:
	rm -rf $(VENV) .venv-trl runs .pytest_cache
