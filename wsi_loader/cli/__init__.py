"""The ``wsi-loader`` command, the top floor: a thin layer over the library.

`main` builds the parser from the subcommands, one module each, named as the command (`index`,
`split`, `info`, `quarantine`, `stain`, `view` for ``inspect`` and ``mosaic``, `export`, `features`,
`predict`, `encoders`, `serve`, `bench`, `demo`); `common` holds the options and printing
they share, `_model_pass` the options of ``features`` and ``predict`` (and `encoders` their
``--weights``/``--strict`` for registry encoders), `_index_on_the_way` their indexing
of slides given instead of an index, `_anndata` the ``.h5ad`` that ``features``
also writes on request, `_demo` the demo's job.

May import every step.
"""

from wsi_loader.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
