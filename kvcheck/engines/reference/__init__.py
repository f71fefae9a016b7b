"""The reference engine package."""
