"""Scaling sweeps and the optimization ladder: ``rayvit sweep`` as a file, for ``ray job submit``.

    ray job submit --working-dir . -- python experiments/scaling.py --config experiments/configs/study_a100.yaml

``python experiments/scaling.py --help`` explains every option.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from rayvit.cli import sweep


def main(argv: Optional[Sequence[str]] = None) -> int:
    return sweep(sys.argv[1:] if argv is None else argv, prog="scaling.py")


if __name__ == "__main__":
    sys.exit(main())
