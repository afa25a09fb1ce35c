"""``python -m tailserve.cli``: the ``tailserve`` command."""

import sys

from tailserve.cli.app import main

sys.exit(main())
