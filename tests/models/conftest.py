"""Real-model tests run only when asked: ``make test-models`` (``AGENTSPEC_TEST_MODELS=1``) fetches
the published GGUF file first (scripts/fetch_model.py); ``make test`` never downloads a model."""

import os

collect_ignore_glob = [] if os.environ.get("AGENTSPEC_TEST_MODELS") == "1" else ["test_*.py"]
