"""The vllm engine package."""
