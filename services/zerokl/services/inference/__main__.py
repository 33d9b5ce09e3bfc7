"""``python -m zerokl.services.inference prefill|decode [flags]``."""
import sys

from zerokl.services.inference.server import DEFAULT_PORTS, main

if len(sys.argv) < 2 or sys.argv[1] not in DEFAULT_PORTS:
    sys.exit(f"usage: python -m zerokl.services.inference {{{'|'.join(DEFAULT_PORTS)}}} [flags]")
sys.exit(main(sys.argv[1], sys.argv[2:]))
