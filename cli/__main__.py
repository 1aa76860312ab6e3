"""`python -m tokenloom.cli`: the same as the `tokenloom` command."""

import sys

from tokenloom.cli.main import main

sys.exit(main())
