"""`python -m asyncwebrl` is the `asyncwebrl` command."""
import sys

from asyncwebrl.cli import main

sys.exit(main())
