"""artifact_fetch_cache: fill the controller cache with the artifacts the fleet's hosts asked for, each verified.

Runs on the controller only (no host is contacted) and downloads with p40fleet's own downloader, p40fleet.fetch
(the collection's one Python dependency, declared in docs/collection.md and the module documentation),
the one `p40fleet fetch` and `p40fleet bundle` use: a file already there with the pinned sha256 is kept without a
request; a download goes to <file>.partial beside it and a cut connection resumes from where it stopped (HTTP
Range, also in a later run), under a lock no second download of the same file gets; the file takes its final
name (one rename) only once its sha256 matches. TLS is verified (requests' default; there is no switch).

Each artifact's result is its own: a download that fails is reported for that path, and the hosts that asked
for it fail in the role, the others carry on. Check mode downloads nothing and reports what a run would fetch.

    artifact_fetch_cache:
      artifacts: [{name, url, sha256, path, size (optional)}, ...]
      timeout: 60
      attempts: 3
"""

from __future__ import annotations

from pathlib import Path

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

ARGUMENT_SPEC = {
    "artifacts": {"type": "list", "elements": "dict", "required": True},
    "timeout": {"type": "int", "default": 60},
    "attempts": {"type": "int", "default": 3},
}


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        _, args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)
        try:
            from p40fleet.fetch import Download, Fetcher, FetchError, sha256_of
        except ImportError as error:
            raise AnsibleActionFail(
                "artifact_fetch's controller source downloads with p40fleet's downloader (p40fleet.fetch), which this"
                f" ansible-playbook cannot import ({error}). Run it from the venv `make deps` makes, or install the"
                " p40fleet wheel into the Python that runs ansible-playbook."
            ) from None
        fetcher = Fetcher(retries=max(args["attempts"] - 1, 0), timeout=float(args["timeout"]))
        results = []
        for artifact in args["artifacts"]:
            path = Path(str(artifact["path"])).expanduser()
            size = artifact.get("size")
            download = Download(
                label=str(artifact["name"]),
                url=str(artifact["url"]),
                dest=path,
                sha256s=frozenset({str(artifact["sha256"]).lower()}),
                size=int(size) if size not in (None, "") else None,
            )
            entry = {"path": str(path), "url": download.url, "failed": False}
            if self._task.check_mode:
                present = path.is_file() and sha256_of(path) in download.sha256s
                entry.update(state="present" if present else "absent", changed=not present)
            else:
                try:
                    outcome = fetcher.fetch(download)
                except FetchError as error:
                    entry.update(failed=True, msg=str(error), state="failed", changed=False)
                else:
                    changed = outcome.state != "present"
                    entry.update(state=outcome.state, changed=changed, bytes=outcome.bytes_transferred)
            results.append(entry)
        result["results"] = results
        result["changed"] = any(entry["changed"] for entry in results)
        return result
