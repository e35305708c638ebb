"""`python -m engine.cli`: the engine's sub-commands without the app."""

import sys

from engine.cli import main, quiet_startup

quiet_startup()
sys.exit(main())
