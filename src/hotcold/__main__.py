import sys

from hotcold.cli import main

sys.exit(main())
