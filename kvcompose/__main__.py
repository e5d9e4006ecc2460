import sys

from kvcompose.cli import main

sys.exit(main())
