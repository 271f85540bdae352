"""``python -m stratus.cli``: the ``stratus`` command."""

import sys

from stratus.cli.main import main

sys.exit(main())
