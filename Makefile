# make quickstart  SFT warm-up, GRPO, then held-out accuracy of the SFT and the RL model (CPU, ~12 min)
# make test       set up .venv on a fresh machine (CPU torch first), the Debian packages tests use, and run the suite
# make rollout    run the small CPU rollout recipe with SmolLM2-135M-Instruct
# make bench      run the benchmarks in bench/ (vs_trl.py sets up TRL in .venv-trl on first use)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup system-packages test quickstart rollout bench clean

# Debian packages the tests drive for real: headless Chromium for the trajectory viewer, bubblewrap
# for the python tool's sandbox.
SYSTEM_PACKAGES := chromium chromium-driver bubblewrap

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch must come first, or pip resolves a multi-GB CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Installs what is missing (needs root or sudo); without them the tests that need them skip and say so.
system-packages:
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing $$missing"; \
		($$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq $$missing >/dev/null) \
			|| echo "warning: could not install $$missing; the tests that need them will skip"; \
	fi

test: setup system-packages
	$(PY) -m agentrl.models smollm2-135m-instruct
	$(PY) -m pytest -q -rs tests

QUICKSTART := recipes/quickstart.yaml
quickstart: setup
	$(PY) -m agentrl.models smollm2-135m-instruct
	$(VENV)/bin/agentrl sft $(QUICKSTART)
	$(VENV)/bin/agentrl train $(QUICKSTART)
	$(VENV)/bin/agentrl eval $(QUICKSTART) model.path=runs/quickstart/sft
	$(VENV)/bin/agentrl eval $(QUICKSTART) model.path=runs/quickstart/final

rollout: setup
	$(VENV)/bin/agentrl rollout recipes/rollout_cpu.yaml

bench: setup
	$(PY) bench/rollout_efficiency.py
	$(PY) bench/vs_trl.py
	$(PY) bench/fsdp_overhead.py
	$(PY) bench/weight_sync.py

clean:
	rm -rf $(VENV) .venv-trl runs .pytest_cache
