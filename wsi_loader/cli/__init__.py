"""The ``wsi-loader`` command (``main``); `main.py` lists the subcommands, one module each."""

from wsi_loader.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
