"""cuda_toolkit's decision on what sits at the install path, from the probe's findings.

`found | cuda_toolkit_classify(version)` is one of:
- installed: version.json and nvcc both say the wanted release, libcudart is there and no attempt is left
  unfinished (the in-progress marker is gone);
- foreign: version.json says another release (it is never deleted: someone else's toolkit);
- absent: nothing at the path;
- partial: anything else that exists (an interrupted install, a tree without its libraries, a marker left).
A flag file alone never counts as installed. Unit-tested in python/tests/test_cuda_toolkit_rules.py.
"""


def cuda_toolkit_classify(found, version):
    want = f"{version}."
    version_json = found.get("version_json") or ""
    if version_json and not f"{version_json}.".startswith(want):
        return "foreign"
    if (
        version_json.startswith(want)
        and found.get("nvcc_release") == version
        and found.get("libcudart")
        and "marker" in found
        and found["marker"] is None
    ):
        return "installed"
    if not found.get("home_exists"):
        return "absent"
    return "partial"


class FilterModule:
    def filters(self):
        return {"cuda_toolkit_classify": cuda_toolkit_classify}
