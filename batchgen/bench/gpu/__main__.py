"""python -m batchgen.bench.gpu: the GPU check."""
import sys

from .check import main

sys.exit(main())
