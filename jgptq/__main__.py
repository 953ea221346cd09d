"""``python -m jgptq``: the command line (see :mod:`jgptq.cli`)."""

import sys

from jgptq.cli import main

sys.exit(main())
