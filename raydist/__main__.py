import sys

from raydist.cli import main

sys.exit(main())
