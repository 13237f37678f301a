"""ray_cluster's network measurement: one all-reduce rank of the cluster's members, run on every member at once.

Run by the env owner with the env's Python and torch (`python -I -c <this source> RANK WORLD ADDRESS PORT BYTES
ITERATIONS BACKEND TIMEOUT`), never by root. The ranks meet at ADDRESS:PORT, the head's fleet address and a port
the role's firewall admits only from the members; Gloo and NCCL pick the fleet interface from GLOO_SOCKET_IFNAME
and NCCL_SOCKET_IFNAME, which the role sets. An fp32 tensor of BYTES is all-reduced once to open the connections,
then ITERATIONS times under the clock. The one line printed is data for the controller's filter
(plugins/filter/ray_cluster_network.py), which parses it strictly and computes the bandwidths.
"""

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    rank, world, address, port, size, iterations, backend, timeout = sys.argv[1:9]
    rank, world, size, iterations = int(rank), int(world), int(size), int(iterations)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address}:{int(port)}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=float(timeout)),
    )
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)

    def done():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    dist.all_reduce(tensor)
    done()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    done()
    seconds = time.perf_counter() - start
    dist.destroy_process_group()
    result = {
        "rank": rank,
        "world": world,
        "backend": backend,
        "bytes": tensor.numel() * 4,
        "iterations": iterations,
        "seconds": seconds,
    }
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
