"""p40fleet's train_run role: read a run's log as the env owner and print only the lines `p40fleet train status`
parses (verl's metric lines, the total steps, the checkpoints saved), the last LIMIT of them, each cut at 4000
characters. Run by root through fleet_state_owner_run: what it prints is the owner's data, parsed strictly there.
A link, a FIFO or anything but a regular file in the log's place prints nothing and exits 3.
    python3 -I p40fleet_train_read.py LOG [LIMIT]
"""

import collections
import os
import stat
import sys

WANTED = ("step:", "Total training steps:", "local_global_step_folder:")


def main(argv):
    path, limit = argv[1], int(argv[2]) if len(argv) > 2 else 5000
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return 2
    except OSError:
        return 3
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            return 3
        kept = collections.deque(maxlen=limit)
        for raw in handle:
            line = raw[:4000].decode("utf-8", "replace").rstrip("\n")
            if line.startswith(WANTED):
                kept.append(line)
    sys.stdout.write("".join(line + "\n" for line in kept))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
