"""`python -m cacheblend_rag.cli`: the `cacheblend-rag` command."""

import sys

from . import main

sys.exit(main())
