#!/usr/bin/env bash
# Record a GPU host's answers to the queries p40fleet makes, verbatim, in python/tests/fixtures/real-hosts/'s format
# ("$ command", then its output); UUIDs and serials are masked as in the files there. usage: record_host.sh OUT
set -u
out=$1
{
    echo "# Recorded $(date -u +%Y-%m-%d) on a real GPU host. Each block: the command after \"\$ \", then its output verbatim."
    echo
    for cmd in \
        "nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version,pci.bus_id,ecc.mode.current,ecc.mode.pending --format=csv,noheader,nounits; echo rc=\$?" \
        "nvidia-smi --query-gpu=memory.total,ecc.mode.current,ecc.mode.pending --format=csv; echo rc=\$?" \
        "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader,nounits; echo rc=\$?" \
        "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits; echo rc=\$?" \
        "nvidia-smi; echo rc=\$?"; do
        echo "\$ $cmd"
        bash -c "$cmd" 2>&1
    done
} | sed -E 's/GPU-[0-9a-f-]{36}/GPU-<uuid>/g; s/(Serial Number *: ).*/\1<serial>/' >"$out"
