"""The sglang engine package."""
