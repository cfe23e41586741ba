"""``python -m kvtransform.bench SUITE [overrides...] [-m]``: the same as ``kvtransform bench``."""
import sys

from . import main

sys.exit(main())
