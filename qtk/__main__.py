"""`python -m qtk ...` (and `torchrun ... -m qtk quantize ...`): the qtk command."""
import sys

from .cli import main

sys.exit(main())
