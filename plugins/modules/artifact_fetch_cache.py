# The documentation of the action plugin plugins/action/artifact_fetch_cache.py, which runs on the controller only
# and has no module of its own: ansible-doc reads an action's documentation from plugins/modules/.

DOCUMENTATION = r"""
module: artifact_fetch_cache
short_description: Fill the controller's cache with the artifacts the fleet's hosts asked for, each verified.
description:
  - Runs on the controller only; no host is contacted. A file already there with the pinned sha256 is kept without
    a request; a download goes to a .partial file, resumes after a cut connection and takes its final name only once
    its sha256 matches. TLS is always verified.
  - Each artifact's result is its own. Check mode downloads nothing and reports what a run would fetch.
  - Downloads with the p40fleet Python package's downloader (p40fleet.fetch), which the Python running
    ansible-playbook must import (docs/collection.md).
author: p40fleet
requirements:
  - the p40fleet Python package, in the Python that runs ansible-playbook
options:
  artifacts:
    description: The artifacts, each {name, url, sha256, path, size (optional)}.
    type: list
    elements: dict
    required: true
  timeout:
    description: Seconds a connection may stall.
    type: int
    default: 60
  attempts:
    description: Tries per artifact.
    type: int
    default: 3
"""

EXAMPLES = r"""
- name: Ensure the controller cache holds each verified artifact
  p40fleet.fleet.artifact_fetch_cache:
    artifacts:
      - name: cuda
        url: "{{ p40fleet_cuda_runfile_url }}"
        sha256: "{{ p40fleet_cuda_runfile_sha256 }}"
        path: ~/.cache/p40fleet/cuda.run
  run_once: true
"""

RETURN = r"""
results:
  description: >-
    Per artifact, {path, url, state (present, downloaded, resumed; absent in check mode; failed), changed,
    failed, msg}.
  type: list
  elements: dict
  returned: always
"""
