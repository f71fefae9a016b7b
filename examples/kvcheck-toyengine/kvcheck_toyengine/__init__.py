"""kvcheck-toyengine: a toy prefix cache (allocator.py), its kvcheck adapter (sut.py) and the
engine plugin that registers both with kvcheck (engine.py, entry point `toyengine`)."""
from pathlib import Path

LAYOUT_DIR = Path(__file__).resolve().parent      # its layouts: kvcheck config files, *.json
HASH_ONLY_HIT = "toy_hash_only_hit"               # its planted fault
