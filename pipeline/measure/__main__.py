import sys

from pipeline.measure.cli import main

sys.exit(main())
