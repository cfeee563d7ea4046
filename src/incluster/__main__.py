import sys

from incluster.cli import main

sys.exit(main())
