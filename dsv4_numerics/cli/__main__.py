"""``python -m dsv4_numerics.cli``: the ``dsv4-numerics`` command."""

import sys

from dsv4_numerics.cli import main

sys.exit(main())
