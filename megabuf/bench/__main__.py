"""`python -m megabuf.bench`: see `megabuf.bench.main`."""

import sys

from megabuf.bench.main import main

sys.exit(main())
