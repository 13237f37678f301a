"""gpu_qualify's load: fp32 matmuls on every visible card for the given seconds (the last argument).

Run by the env owner with the env's Python and torch (as `python -c <this source> SECONDS`); root never runs it
and never reads what it prints: the facts are root's nvidia-smi samples taken meanwhile. Each card gets square
fp32 matrices sized to a quarter of its free memory (capped at 8192, where a P40 is fully busy), one thread per
card, so every card is loaded at once, as training loads them.
"""

import sys
import threading
import time

import torch

CAP = 8192


def load(device, until):
    free, _total = torch.cuda.mem_get_info(device)
    side = min(CAP, int((free / 4 / 3 / 4) ** 0.5) // 256 * 256)
    a = torch.randn(side, side, device=device)
    b = torch.randn(side, side, device=device)
    while time.monotonic() < until:
        for _ in range(8):
            c = a @ b
        torch.cuda.synchronize(device)
    del a, b, c


def main():
    seconds = float(sys.argv[-1])
    if not torch.cuda.is_available():
        print("gpu_qualify load: torch sees no CUDA device", file=sys.stderr)
        return 3
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=load, args=(i, until)) for i in range(torch.cuda.device_count())]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
