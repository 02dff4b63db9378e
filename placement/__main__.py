"""``python -m placement``: the placement dry run (see placement.dryrun)."""

import sys

from placement.dryrun import main

sys.exit(main())
