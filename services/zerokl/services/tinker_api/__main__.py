"""``python -m zerokl.services.tinker_api`` (the same as ``zerokl serve tinker``)."""
import sys

from zerokl.services.tinker_api.server import main

sys.exit(main())
