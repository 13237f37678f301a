"""Root's sampler of a qualification (roles/gpu_qualify): runs nvidia-smi's sampling loop until the role touches the
stop file (the load has ended) or the longest the load may take has passed, then prints what nvidia-smi printed.

argv: STOP_FILE MAX_SECONDS COMMAND... (the stop file in a directory root made for this run, 0700).
Exit: 0 when stopped (the loop never ends by itself), else nvidia-smi's own exit code, its message in the output:
a sampler that failed at once (`Field "serial" is not a valid field to query.`) says so, with its words.
Runs with the host's system Python (Debian 11's 3.9 included).
"""

import os
import subprocess
import sys
import tempfile
import time

POLL_SECONDS = 0.5


def main(argv):
    stop_file, limit, command = argv[0], float(argv[1]), argv[2:]
    deadline = time.monotonic() + limit
    # A file, not a pipe: a long loop's rows would fill a pipe nobody reads until the end.
    with tempfile.TemporaryFile() as output:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
        stopped = False
        while child.poll() is None:
            if os.path.exists(stop_file) or time.monotonic() >= deadline:
                child.terminate()
                try:
                    child.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                stopped = True
                break
            time.sleep(POLL_SECONDS)
        output.seek(0)
        sys.stdout.write(output.read().decode("utf-8", errors="replace"))
    if stopped:
        return 0
    # Ended by a signal: the shell's code for it.
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
