"""Run real vLLM CPU replicas locally: venv install, a tiny random-weight model, launcher."""
