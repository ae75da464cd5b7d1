"""``python -m tpcore``: the ``tpcore`` console script."""

import sys

from tpcore.tools.cli import main

sys.exit(main())
