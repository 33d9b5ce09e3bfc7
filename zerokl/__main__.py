import sys

from zerokl.cli import main

sys.exit(main())
