"""`python -m app [strata chat options]`."""

import sys

from app.main import run_app

sys.exit(run_app())
