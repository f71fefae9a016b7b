from .checker.cli import entry

entry()
