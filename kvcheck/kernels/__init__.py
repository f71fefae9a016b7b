"""Hybrid-attention ops, batch-invariant PyTorch implementations (a leaf package: imports nothing
else from kvcheck). Each module docstring says how its invariance is achieved."""
