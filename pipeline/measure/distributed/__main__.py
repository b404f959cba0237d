import sys

from pipeline.measure.distributed.cli import main

sys.exit(main())
