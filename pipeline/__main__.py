import os
import sys

from pipeline.cli import end, main

try:
    code = main()
except BrokenPipeError:  # the reader went away (`... | head`): no traceback, the shell's exit code for SIGPIPE
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 141
end(code)
