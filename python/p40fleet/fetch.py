"""Download pinned files for the fleet: resumable, sha256-verified, atomic, and never twice.

The pins are read from the role defaults and the inventory by playbooks/pins.yml, as site.yml sees them per host
(one home per pin: nothing is restated here). `p40fleet fetch` fills the controller cache that
roles/artifact_fetch reads in controller mode (<artifact_fetch_controller_cache_dir>/<name>/<file name>), and the
role fills it with the same downloader (its action plugin artifact_fetch_cache); p40fleet.bundle writes a whole
mirror directory with it too: one downloader for every file the controller keeps.

A download goes to <dest>.partial beside the destination: a cut connection is resumed from where it stopped
(HTTP Range), now or by a later run; the file moves into place (os.replace, one rename on one filesystem) only
once its sha256 matches the pin. A file already there with the right sha256 is kept without any request. TLS
is requests' default, certificate verification included; there is no switch to turn it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import unquote, urlsplit

import requests
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from p40fleet.paths import PLAYBOOKS_DIR, ROLES_DIR
from p40fleet.run import run_playbook

PINS_PLAYBOOK = PLAYBOOKS_DIR / "pins.yml"
PINS_TASK = "Report the host's pins"
SHA256 = re.compile(r"^[0-9a-f]{64}$")
CHUNK = 1 << 20
# Bytes per read from the network: what a cut connection loses of the block it was reading.
NETWORK_CHUNK = 1 << 16


class FetchError(RuntimeError):
    """A download or a pin is wrong; the message names the file, what was found and what to do."""


@dataclass(frozen=True)
class Download:
    """One file to put at dest: from url, accepted only with one of the sha256s."""

    label: str
    url: str
    dest: Path
    sha256s: frozenset[str]
    size: int | None = None

    def describe_sums(self) -> str:
        if len(self.sha256s) == 1:
            return next(iter(self.sha256s))
        return f"one of {', '.join(sorted(self.sha256s))}"


@dataclass
class Outcome:
    download: Download
    state: str  # "present" (valid, no request), "downloaded" or "resumed"
    bytes_transferred: int = 0


def file_name(url: str) -> str:
    """The file name artifact_fetch derives from a URL (its path's basename), unquoted."""
    name = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    if not name or name in (".", ".."):
        raise FetchError(f"{url}: no file name in the URL's path")
    return name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Retry(Exception):
    """The transfer stopped early; resume it."""


class Fetcher:
    """Downloads with resume, verification and a progress bar (plain lines when stderr is not a terminal)."""

    def __init__(
        self,
        console: Console | None = None,
        session: requests.Session | None = None,
        retries: int = 5,
        timeout: float = 60.0,
        backoff: float = 2.0,
    ) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.session = session or requests.Session()
        self.retries = retries
        self.timeout = timeout
        self.backoff = backoff

    def fetch_all(self, downloads: Iterable[Download]) -> list[Outcome]:
        downloads = list(downloads)
        outcomes = []
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, disable=not self.console.is_terminal) as progress:
            for download in downloads:
                outcome = self.fetch(download, progress)
                outcomes.append(outcome)
                self.console.print(f"  {outcome.state:10} {download.dest}", soft_wrap=True)
        return outcomes

    def fetch(self, download: Download, progress: Progress | None = None) -> Outcome:
        dest = download.dest
        if dest.is_file():
            if sha256_of(dest) in download.sha256s:
                return Outcome(download, "present")
            # A wrong file never stays under the final name, also if the download below fails.
            dest.unlink()
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(dest.name + ".partial")
        with partial.open("ab") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise FetchError(f"{dest}: another p40fleet is downloading it right now ({partial})") from None
            resumed_from = handle.tell()
            try:
                transferred = self._transfer(download, handle, progress)
            except FetchError:
                if handle.tell() == 0:
                    partial.unlink()  # nothing to resume from
                raise
            handle.flush()
            os.fsync(handle.fileno())
            digest = sha256_of(partial)
            if digest not in download.sha256s and resumed_from > 0:
                # The partial file may be left from another file under this name: once more, from scratch.
                handle.truncate(0)
                handle.seek(0)
                resumed_from = 0
                transferred = self._transfer(download, handle, progress)
                handle.flush()
                os.fsync(handle.fileno())
                digest = sha256_of(partial)
            if digest not in download.sha256s:
                partial.unlink()
                raise FetchError(
                    f"{download.label}: {download.url} gave a file with sha256 {digest}, but the pin is"
                    f" {download.describe_sums()}. Refused: nothing was kept at {dest}. Check that the URL"
                    " (or mirror) serves the pinned file and that the pin is right."
                )
            os.replace(partial, dest)
        _fsync_dir(dest.parent)
        return Outcome(download, "resumed" if resumed_from else "downloaded", transferred)

    def _transfer(self, download: Download, handle, progress: Progress | None) -> int:
        """Append the rest of the file to handle (its position is what is there already); bytes moved."""
        task = progress.add_task(download.dest.name, total=download.size) if progress is not None else None
        moved = [0]  # bytes written by every attempt, also the ones cut short
        attempt = 0
        try:
            while True:
                try:
                    self._request(download, handle, progress, task, moved)
                    return moved[0]
                except _Retry as reason:
                    attempt += 1
                    if attempt > self.retries:
                        raise FetchError(
                            f"{download.label}: downloading {download.url} failed {attempt} times ({reason});"
                            f" {handle.tell()} bytes are kept in {download.dest}.partial and the next run resumes"
                            " from there. Check the network or the server."
                        ) from None
                    time.sleep(min(self.backoff * 2 ** (attempt - 1), 30.0))
        finally:
            if progress is not None:
                progress.remove_task(task)

    def _request(self, download: Download, handle, progress: Progress | None, task, moved: list[int]) -> None:
        offset = handle.tell()
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            response = self.session.get(download.url, headers=headers, stream=True, timeout=self.timeout)
        except requests.exceptions.SSLError as error:
            raise FetchError(f"{download.label}: TLS verification of {download.url} failed: {error}") from None
        except (requests.ConnectionError, requests.Timeout) as error:
            raise _Retry(f"connection: {error}") from None
        with response:
            if response.status_code == 416 and offset:
                # Nothing after offset: the partial file may be complete; the checksum decides.
                return
            if response.status_code >= 500 or response.status_code == 429:
                raise _Retry(f"HTTP {response.status_code}")
            if response.status_code not in (200, 206):
                raise FetchError(
                    f"{download.label}: {download.url} answered HTTP {response.status_code} {response.reason}."
                    f" Nothing was kept at {download.dest}. Check the URL (or mirror) and the pin."
                )
            if response.status_code == 206:
                start = _content_range_start(response.headers.get("Content-Range", ""))
                if start != offset:
                    raise FetchError(
                        f"{download.label}: {download.url} answered a request for bytes from {offset} with"
                        f" Content-Range {response.headers.get('Content-Range')!r}: the server's ranges are broken."
                    )
            elif offset:
                # The server ignored the Range header: start again from the first byte.
                handle.truncate(0)
                handle.seek(0)
                offset = 0
            length = response.headers.get("Content-Length")
            if progress is not None:
                total = offset + int(length) if length and length.isdigit() else download.size
                progress.update(task, total=total, completed=offset)
            try:
                for block in response.iter_content(NETWORK_CHUNK):
                    handle.write(block)
                    moved[0] += len(block)
                    if progress is not None:
                        progress.advance(task, len(block))
            except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError, requests.Timeout) as error:
                handle.flush()
                raise _Retry(f"cut after {handle.tell()} bytes: {error}") from None
            handle.flush()
            if download.size is not None and handle.tell() < download.size:
                raise _Retry(f"cut after {handle.tell()} of {download.size} bytes")


def _content_range_start(value: str) -> int | None:
    match = re.match(r"bytes (\d+)-\d+/(\d+|\*)$", value.strip())
    return int(match.group(1)) if match else None


# -- pins ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Artifact:
    """One file a role fetches through artifact_fetch (name is the artifact_fetch_name it passes)."""

    name: str
    url: str
    sha256: str
    size: int | None = None

    @property
    def file_name(self) -> str:
        return file_name(self.url)


@dataclass
class HostPins:
    host: str
    artifacts: list[Artifact]
    controller_cache_dir: Path
    python_version: str
    pip: dict
    torch_requirements: list[str]
    apex: dict
    verl: dict = field(default_factory=dict)
    torch_lock_file: str = ""

    @property
    def torch_lock(self) -> Path:
        """The torch lock the pytorch role copies to the host (an absolute path, or one in its files/)."""
        path = Path(self.torch_lock_file).expanduser()
        return path if path.is_absolute() else ROLES_DIR / "pytorch" / "files" / path

    @property
    def verl_lock(self) -> Path:
        """The lock file the verl role copies to the host (an absolute path, or one in its files/)."""
        path = Path(self.verl["lock_file"]).expanduser()
        return path if path.is_absolute() else ROLES_DIR / "verl" / "files" / path


def _artifact(host: str, raw: dict) -> Artifact:
    url = str(raw.get("url") or "")
    sha256 = str(raw.get("sha256") or "").lower()
    if not re.match(r"^https?://", url):
        raise FetchError(f"{host}: artifact {raw.get('name')} has URL {url!r}; required: an http(s) URL. Fix the pin.")
    if not SHA256.match(sha256):
        raise FetchError(
            f"{host}: artifact {raw.get('name')} has sha256 {raw.get('sha256')!r}; required: 64 hex digits."
            " Fix the pin."
        )
    size = raw.get("size")
    return Artifact(str(raw["name"]), url, sha256, int(size) if size not in (None, "") else None)


def read_pins(inventory: Path | str, limit: str | None = None, extravars: dict | None = None) -> list[HostPins]:
    """Every host's pins, as site.yml would see them (playbooks/pins.yml; nothing runs on the hosts)."""
    inventory = Path(inventory)
    if not inventory.exists():
        raise FetchError(f"inventory {inventory} not found: copy inventory/hosts.example.yml and edit it")
    cmdline = ["--limit", limit] if limit else []
    # Not a run of the fleet: its runner files stay out of the inventory's run history (the state directory).
    with tempfile.TemporaryDirectory(prefix="p40fleet-pins-") as state_dir:
        result = run_playbook(PINS_PLAYBOOK, inventory, cmdline=cmdline, extravars=extravars, state_dir=state_dir)
    if result.failures or result.rc != 0:
        problems = "; ".join(f"{f.host}: {f.message}" for f in result.failures) or result.stdout[-2000:]
        raise FetchError(f"reading the pins from {inventory} failed: {problems}")
    pins = []
    for event in result.events:
        data = event.get("event_data", {})
        if event.get("event") != "runner_on_ok" or data.get("task") != PINS_TASK:
            continue
        host, raw = data["host"], data["res"]["msg"]
        pins.append(
            HostPins(
                host=host,
                artifacts=[_artifact(host, a) for a in raw["artifacts"]],
                controller_cache_dir=Path(str(raw["controller_cache_dir"])).expanduser(),
                python_version=str(raw["python_version"]),
                pip=raw["pip"],
                torch_requirements=[str(r) for r in raw["torch_requirements"]],
                torch_lock_file=str(raw["torch_lock_file"]),
                apex=raw["apex"],
                verl=raw["verl"],
            )
        )
    if not pins:
        raise FetchError(f"no host of group p40-hosts in {inventory}{' matches ' + limit if limit else ''}")
    return sorted(pins, key=lambda p: p.host)


def unique(downloads: Sequence[Download]) -> list[Download]:
    """One download per destination, acceptable to every pin that wants it; pins that disagree are an error."""
    by_dest: dict[Path, Download] = {}
    for download in downloads:
        seen = by_dest.get(download.dest)
        if seen is None:
            by_dest[download.dest] = download
        elif seen.sha256s & download.sha256s:
            by_dest[download.dest] = replace(seen, sha256s=seen.sha256s & download.sha256s)
        else:
            raise FetchError(
                f"{download.dest}: two different pins want this file name ({seen.label}: {seen.describe_sums()};"
                f" {download.label}: {download.describe_sums()}). One mirror or cache can hold only one of them:"
                " make the fleet's pins agree."
            )
    return list(by_dest.values())


def controller_cache_downloads(pins: Sequence[HostPins]) -> list[Download]:
    """Where artifact_fetch's controller source looks: <cache dir>/<name>/<file name> (fetch_controller.yml)."""
    downloads = [
        Download(
            label=artifact.name,
            url=artifact.url,
            dest=host.controller_cache_dir / artifact.name / artifact.file_name,
            sha256s=frozenset({artifact.sha256}),
            size=artifact.size,
        )
        for host in pins
        for artifact in host.artifacts
    ]
    return unique(downloads)


def fill_controller_cache(
    inventory: Path | str, limit: str | None = None, fetcher: Fetcher | None = None
) -> list[Outcome]:
    """`p40fleet fetch`: every pinned artifact into the controller cache, verified."""
    fetcher = fetcher or Fetcher()
    return fetcher.fetch_all(controller_cache_downloads(read_pins(inventory, limit)))
