"""Worker entry point: ``torchrun --nproc-per-node N -m loom.train [--config F] [--a.b v ...]``."""

import faulthandler
import sys

from loom.cli.errors import user_errors_exit
from loom.cli.train import run_worker

if __name__ == "__main__":
    faulthandler.enable()  # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack to stderr
    user_errors_exit(run_worker)(sys.argv[1:])
