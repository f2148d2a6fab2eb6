# Quickstart: `make run` (set up, then run the main job) and `make test` (set up, then run the tests).
.PHONY: setup run test test-unit bench test-sglang

setup:
	@bash scripts/setup.sh

run: setup
	.venv/bin/agentspec serve --repo .

test: setup
	.venv/bin/python -m pytest tests -q --durations=15

# the fast part (no model, no server: about a minute), for edit-test loops; `make test` runs everything
test-unit: setup
	.venv/bin/python -m pytest tests/unit -q

bench: setup
	.venv/bin/python -m benchmarks.bench_e2e

# SGLang (CPU, NGRAM speculation) as test infrastructure: its own venv, see scripts/setup_sglang.sh
test-sglang:
	bash scripts/setup_sglang.sh && .venv-sglang/bin/python -m pytest tests/sglang -q
