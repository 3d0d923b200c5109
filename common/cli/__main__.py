"""`python -m common.cli ...`: the same as the `pdserve` command."""

import sys

from common.cli.main import main

sys.exit(main())
