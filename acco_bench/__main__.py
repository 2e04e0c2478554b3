"""``python -m acco_bench``: the acco-bench command."""

import sys

from acco_bench.cli import main

sys.exit(main())
