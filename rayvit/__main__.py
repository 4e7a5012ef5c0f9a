"""``python -m rayvit`` is the ``rayvit`` command."""

import sys

from rayvit.cli import main

sys.exit(main())
