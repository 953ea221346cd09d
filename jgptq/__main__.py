"""``python -m jgptq``: the command line (see :mod:`jgptq.cli`)."""

import sys

from jgptq.cli import main

if __name__ == "__main__":
    sys.exit(main())
