import sys

from pipeline.sweep.cli import main

sys.exit(main())
