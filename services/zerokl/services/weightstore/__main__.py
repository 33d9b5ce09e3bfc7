"""``python -m zerokl.services.weightstore --root DIR --port N``."""
import sys

from zerokl.services.weightstore.server import main

sys.exit(main(sys.argv[1:]))
