"""p40fleet: provision fleets of old NVIDIA GPU hosts for verl PPO training, driven by Ansible.

As a library: `p40fleet.provision(inventory, limit=..., tags=..., extra_vars=..., check=...)`
returns a `ProvisionResult` (see p40fleet.api)."""

__version__ = "0.1.0"

_API = ("provision", "ProvisionResult", "HostResult", "HostStats", "HostFailure", "RunLocked", "RunError")


def __getattr__(name: str):
    # The library API is imported on first use, so `import p40fleet.paths` stays cheap.
    if name in _API:
        from p40fleet import api, lock

        return getattr(api, name, None) or getattr(lock, name)
    raise AttributeError(f"module 'p40fleet' has no attribute {name!r}")
