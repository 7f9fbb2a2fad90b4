"""torchrun's agent for `--nproc`, quiet: the ranks' own lines are a run's only output.

torchrun logs its workers' exits and, when one fails or a signal stops it, ends in a traceback of its
own after the ranks have said what happened. Here its logging is off and it exits as the ranks did: the
largest of their exit codes (a bad input's 2 over the 1 of the ranks it stopped), or 128 + the signal.
"""

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def _exit_code(code: int) -> int:
    """A worker killed by a signal has a negative exit code."""
    return 128 - code if code < 0 else code


def main(argv: list[str]) -> int:
    logging.disable(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as err:
        return max((_exit_code(failure.exitcode) for failure in err.failures.values()), default=1)
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
