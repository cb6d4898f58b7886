"""``python -m torchcal``: the same as the ``torchcal`` command."""

import sys

from torchcal.cli import main

sys.exit(main())
