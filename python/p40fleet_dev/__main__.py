import sys

from p40fleet_dev.cli import main

sys.exit(main())
