import sys

from settled.cli import main

sys.exit(main())
