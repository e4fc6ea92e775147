import sys

from tokenspeed_aio.cli import main

sys.exit(main())
