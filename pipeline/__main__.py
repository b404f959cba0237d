import os
import sys

# torch's C++ warnings (DDP's timing statistics on the meta device) would reach the user's terminal from the
# simulations; set before torch is imported, inherited by the processes the layouts table starts. The measuring
# commands keep them for their logs.
if sys.argv[1:2] in (["estimate"], ["serve"]):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from pipeline.cli import end, main

try:
    code = main()
except BrokenPipeError:  # the reader went away (`... | head`): no traceback, the shell's exit code for SIGPIPE
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 141
end(code)
