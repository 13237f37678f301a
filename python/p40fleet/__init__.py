"""p40fleet: provision fleets of old NVIDIA GPU hosts for verl PPO training, driven by Ansible."""

__version__ = "0.1.0"
