"""``python -m jgptq_torch``: the command line (the same as the ``jgptq`` command; see :mod:`jgptq_torch.cli.main`)."""

import sys

from jgptq_torch.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
