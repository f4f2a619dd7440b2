"""`python -m k2_data.rephrase ...`: the pipeline without the `k2` command (same arguments)."""

import sys

from k2_data.rephrase.cli import main

sys.exit(main())
