"""The hashchain engine package."""
