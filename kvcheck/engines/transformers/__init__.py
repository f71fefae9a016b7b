"""The transformers engine package."""
