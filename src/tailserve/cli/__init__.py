"""The ``tailserve`` command line (``tailserve.cli:main``, pyproject's console script): ``app.py``
builds the parser from one module per subcommand; ``base.py``, ``options.py``,
``policy_flags.py``, ``sweep_options.py`` and ``run_outputs.py`` are what the commands share."""

from tailserve.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
