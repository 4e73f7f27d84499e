"""`python -m loraplex.bench` is `loraplex bench`."""

import sys

from loraplex.bench.run import main

sys.exit(main())
