"""The `serversync` command line: one module per command, each adding its own arguments and
running them (parser.py puts them together, entry.py runs one), and render.py for what they
print."""

from consumer.app.cli.entry import main
from consumer.app.cli.parser import build_parser

__all__ = ["build_parser", "main"]
