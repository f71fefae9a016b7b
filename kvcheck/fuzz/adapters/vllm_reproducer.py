"""Standalone reproducers (placeholder)."""
def write_reproducer(trace, path):
    return {}
