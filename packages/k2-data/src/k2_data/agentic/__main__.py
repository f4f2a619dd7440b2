import sys

from k2_data.agentic.cli import main

sys.exit(main())
