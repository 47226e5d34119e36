"""python -m bench [flags]: the benchmark (flags: python -m bench -h)."""
import sys

from bench.benchmark import main

sys.exit(main())
