"""``python -m vllm_dlite.train``: see :mod:`vllm_dlite.train.cli`."""

import sys

from vllm_dlite.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
