"""`qlora ARGS` that SIGKILLs itself at the Nth write under a folder (the fault campaign's child).

An audit hook sees every file the run opens for writing and every rename, removal and new folder under
FAULT_DIR, whichever module does it; at event number FAULT_KILL_AT (0: never) the process kills itself
with SIGKILL, the one signal nothing can catch, after noting in FAULT_REPORT where it was. At exit it prints how many events it saw.
"""

import atexit
import os
import signal
import sys

WATCH = os.path.realpath(os.environ["FAULT_DIR"])
KILL_AT = int(os.environ.get("FAULT_KILL_AT", "0"))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
CHANGES = {"os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.mkdir"}
events = 0


def _is_write(event: str, args: tuple) -> bool:
    if event == "open":
        mode, flags = args[1], args[2]
        return bool((isinstance(mode, str) and set(mode) & set("wax+")) or (flags or 0) & WRITE_FLAGS)
    return event in CHANGES


def hook(event: str, args: tuple) -> None:
    global events
    if not _is_write(event, args) or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    if not os.path.abspath(os.fsdecode(args[0])).startswith(WATCH):
        return
    events += 1
    if events == KILL_AT:
        with open(os.environ["FAULT_REPORT"], "a") as report:
            report.write(f"{event} {os.path.relpath(os.fsdecode(args[0]), WATCH)}\n")
        os.kill(os.getpid(), signal.SIGKILL)


atexit.register(lambda: print(f"fault-events {events}", file=sys.stderr))
sys.addaudithook(hook)
sys.argv = ["qlora", *sys.argv[1:]]
from qlora_cli.cli import main  # noqa: E402 (after the hook, so that every write is seen)

main()
