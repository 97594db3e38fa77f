"""``python -m xattn.cli``: the ``xattn`` command."""

import sys

from xattn.cli.parser import main

sys.exit(main())
