"""kvcheck: verification toolkit for prefix-cache reuse in hybrid-attention LLM serving."""
__version__ = "0.1.0"
