import sys

from rayfed_dg.cli import main

sys.exit(main())
