"""The fastest setting within an accuracy budget: ``rayvit search`` as a file, for ``ray job submit``.

    ray job submit --working-dir . -- python experiments/search.py --config experiments/configs/search_cpu.yaml

``python experiments/search.py --help`` explains every option.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from rayvit.cli import search


def main(argv: Optional[Sequence[str]] = None) -> int:
    return search(sys.argv[1:] if argv is None else argv, prog="search.py")


if __name__ == "__main__":
    sys.exit(main())
