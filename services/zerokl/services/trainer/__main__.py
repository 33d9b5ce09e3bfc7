"""``python -m zerokl.services.trainer [flags]`` (the same as ``zerokl serve trainer``)."""
import sys

from zerokl.services.trainer.server import main

sys.exit(main(sys.argv[1:]))
