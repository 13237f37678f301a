"""A Ray job that runs one small CPU task on every alive node of the cluster and prints where each ran.

Submitted by p40fleet-ray-submit --nodes: proof that the job path reaches every member before a training run.
Each task is pinned to its node (NodeAffinitySchedulingStrategy, soft=False) and reports that node's host name
and the NCCL/Gloo interface its raylet passed on.
"""

import os
import socket
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=1, num_gpus=0)
def where():
    return socket.gethostname(), os.environ.get("NCCL_SOCKET_IFNAME", ""), os.environ.get("GLOO_SOCKET_IFNAME", "")


def main():
    ray.init()
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeName"])
    refs = [
        where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n["NodeID"], soft=False)).remote()
        for n in nodes
    ]
    results = ray.get(refs, timeout=300)
    for node, (host, nccl, gloo) in zip(nodes, results, strict=True):
        print(f"p40fleet-node {node['NodeName']} ran on {host} NCCL_SOCKET_IFNAME={nccl} GLOO_SOCKET_IFNAME={gloo}")
    print(f"p40fleet-nodes {len(results)}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
