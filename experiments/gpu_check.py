"""The GPU check: ``rayvit gpu-check`` as a file, for ``ray job submit --entrypoint-num-gpus 1``.

    ray job submit --working-dir . --entrypoint-num-gpus 1 -- python experiments/gpu_check.py --quick

``python experiments/gpu_check.py --help`` lists the checks and options.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from rayvit.cli import gpu_check


def main(argv: Optional[Sequence[str]] = None) -> int:
    return gpu_check(list(sys.argv[1:] if argv is None else argv), prog="gpu_check.py")


if __name__ == "__main__":
    sys.exit(main())
