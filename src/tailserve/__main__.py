"""``python -m tailserve``: the ``tailserve`` command, as ``python -m tailserve.cli``."""

import sys

from tailserve.cli.app import main

sys.exit(main())
