"""The command loop the suites' second processes (peer.py, gpu_peer.py)
share: one command a line on stdin, one JSON reply a line on stdout."""

import json
import sys


def answer_commands(commands, lines=None, out=None):
    """Answers each line `NAME ARGS...` with `commands[NAME](*ARGS)` as one
    JSON line, until `exit` or the end of input; an unknown name gets an
    error string back, not an exception."""
    lines = sys.stdin if lines is None else lines
    out = sys.stdout if out is None else out
    for line in lines:
        command, *rest = line.split()
        if command == "exit":
            break
        handler = commands.get(command)
        reply = handler(*rest) if handler else f"unknown command {command!r}"
        print(json.dumps(reply), file=out, flush=True)
