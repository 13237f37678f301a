"""p40fleet pytorch post-install check: what the env's torch really reports, and a tensor op on the GPU.

argv[1]: "gpu" to demand a visible GPU and run a small tensor op on it. Prints one JSON object.
"""

import json
import subprocess
import sys

result = {"errors": []}
try:
    import torch

    result.update(
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
    )
    if len(sys.argv) > 1 and sys.argv[1] == "gpu":
        result["gpu_name"] = torch.cuda.get_device_name(0) if result["cuda_available"] else ""
        value = (torch.ones(4, device="cuda") * 2).sum().item()
        result["gpu_tensor_op"] = value
        if value != 8:
            result["errors"].append(f"a tensor op on the GPU gave {value}, not 8")
except Exception as error:  # the check reports any failure to Ansible as data
    result["errors"].append(f"{type(error).__name__}: {error}")
config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
result["pip_config"] = config.stdout.splitlines()
print(json.dumps(result))
