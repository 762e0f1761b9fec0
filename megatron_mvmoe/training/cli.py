"""Console script `mvmoe-pretrain` (setup.py entry point): same as
`python -m megatron_mvmoe.training.pretrain`."""

import sys

from megatron_mvmoe.training.startup import main as _main


def main() -> int:
    return _main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
