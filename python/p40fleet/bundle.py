"""`p40fleet bundle DIR`: one directory a fleet mirror serves as is, for fleets with no other source.

Layout (what the roles read in their mirror modes; the base URL is where the mirror serves DIR):

  <file name of each pinned URL>   the artifacts (CUDA runfile, cuDNN, Miniconda), artifact_fetch_source mirror
  wheels/                          every wheel the env's pip calls need, with an index.html pip reads as
                                   find-links: pytorch_source mirror (the pytorch role's pip.conf)
  git/apex.git, git/verl.git       the pinned commits' repositories, ready for git over plain HTTP:
                                   apex_git_source / verl_git_source mirror
  git/apex.bundle, git/verl.bundle the same history as single files (`git clone FILE.bundle`), to carry around
  SHA256SUMS                       every file above but the repositories' insides (`sha256sum -c SHA256SUMS`)

The wheels: exactly the files of the torch lock (the +cu118 builds and what they pull in, from the sources the
torch install names: pytorch_index_url alone, or the find-links), of the verl lock and of Apex's build tools, all
hash-pinned: only a file with one of the pinned sha256 is accepted, for the env's Python on x86_64 Linux, every
wheel of a pin that some glibc from 2.5 to 2.28 can use (the host's pip picks its own), the sdist where there is
no wheel. Every file goes through p40fleet.fetch (resume, verification, atomic move, valid files kept).

Not in a bundle: the Hub's dataset and model (training_data: its `path` or `controller` sources) and vLLM
(verl_install_vllm: refused, its wheel has no sha256 pin). conda fetches nothing: conda_env clones the env
offline from the pinned installer's own Python.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote, unquote, urljoin, urlsplit

import requests
from packaging.markers import Marker
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from p40fleet.fetch import (
    Download,
    Fetcher,
    FetchError,
    HostPins,
    Outcome,
    read_pins,
    sha256_of,
    unique,
)

# x86_64 Linux, oldest glibc first: pip prefers a wheel more hosts can use. The verl locks are resolved for
# manylinux_2_28, so every locked pin has a file one of these can install; PyTorch's own +cu118 wheels are
# tagged linux_x86_64.
PLATFORMS = (
    "manylinux1_x86_64",
    "manylinux2010_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{minor}_x86_64" for minor in range(5, 29)),
    "linux_x86_64",
)
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
GIT_DIR = "git"
WHEELS_DIR = "wheels"
# A branch at the pinned commit, so a plain clone of the served repository has it.
PINNED_BRANCH = "refs/heads/p40fleet-pinned"


# -- hash-pinned requirements (the verl lock, Apex's build tools) --------------------------------------


@dataclass(frozen=True)
class Pinned:
    name: str
    version: str
    sha256s: frozenset[str]
    marker: str | None = None


def parse_hashed_requirements(text: str, origin: str) -> list[Pinned]:
    """`name==version [; marker] --hash=sha256:...` lines (pip's hash-checking mode), continuations joined."""
    joined = re.sub(r"\\\s*\n", " ", text)
    pins = []
    for number, raw in enumerate(joined.splitlines(), start=1):
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line:
            continue
        hashes = frozenset(h.lower() for h in re.findall(r"--hash[= ]sha256:([0-9a-fA-F]{64})", line))
        requirement = re.sub(r"--hash[= ]\S+", "", line).strip()
        requirement, _, marker = requirement.partition(";")
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;]+)", requirement.strip())
        if not match or not hashes:
            raise FetchError(f"{origin}: line {number} is not 'NAME==VERSION --hash=sha256:...': {raw.strip()!r}")
        pins.append(Pinned(canonicalize_name(match.group(1)), match.group(3), hashes, marker.strip() or None))
    return pins


def supported_tags(python_version: str) -> list[Tag]:
    """What pip on a CPython `python_version` x86_64 Linux host accepts, best first."""
    version = tuple(int(part) for part in python_version.split(".")[:2])
    interpreter = f"cp{version[0]}{version[1]}"
    return [*cpython_tags(version, platforms=PLATFORMS), *compatible_tags(version, interpreter, PLATFORMS)]


def marker_applies(marker: str | None, python_version: str) -> bool:
    if marker is None:
        return True
    environment = {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }
    return Marker(marker).evaluate(environment)


@dataclass(frozen=True)
class Link:
    url: str
    filename: str
    sha256: str | None


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


class LinkFinder:
    """Files offered by package indexes (PEP 691 JSON or PEP 503 HTML) and find-links pages, as pip reads them."""

    def __init__(self, session: requests.Session, timeout: float = 60.0) -> None:
        self.session = session
        self.timeout = timeout
        self._pages: dict[str, list[Link]] = {}

    def page(self, url: str, missing_ok: bool = False) -> list[Link]:
        if url in self._pages:
            return self._pages[url]
        try:
            accept = {"Accept": f"{SIMPLE_JSON}, text/html;q=0.1"}
            response = self.session.get(url, headers=accept, timeout=self.timeout)
        except requests.RequestException as error:
            raise FetchError(f"reading the package listing {url} failed: {error}") from None
        if response.status_code == 404 and missing_ok:
            links: list[Link] = []
        elif response.status_code != 200:
            raise FetchError(f"the package listing {url} answered HTTP {response.status_code} {response.reason}")
        elif response.headers.get("Content-Type", "").split(";")[0].strip() == SIMPLE_JSON:
            links = [
                Link(urljoin(response.url, f["url"]), f["filename"], (f.get("hashes") or {}).get("sha256"))
                for f in response.json().get("files", [])
            ]
        else:
            parser = _Anchors()
            parser.feed(response.text)
            links = []
            for href in parser.hrefs:
                absolute = urljoin(response.url, html.unescape(href))
                path, _, fragment = absolute.partition("#")
                sha = fragment[len("sha256=") :].lower() if fragment.startswith("sha256=") else None
                links.append(Link(path, unquote(urlsplit(path).path.rsplit("/", 1)[-1]), sha))
        self._pages[url] = links
        return links

    def files(self, name: str, index_urls: Sequence[str], find_links: Sequence[str]) -> list[Link]:
        found = []
        for index in index_urls:
            found += self.page(index.rstrip("/") + "/" + canonicalize_name(name) + "/", missing_ok=True)
        for page in find_links:
            found += self.page(page)
        return found


def _distribution(filename: str):
    """(name, version, tags or None for an sdist), or None for anything else."""
    try:
        if filename.endswith(".whl"):
            name, version, _, tags = parse_wheel_filename(filename)
            return name, version, tags
        name, version = parse_sdist_filename(filename)
        return name, version, None
    except (InvalidWheelFilename, InvalidSdistFilename, ValueError):
        return None


def choose_files(pin: Pinned, links: Iterable[Link], tags: Sequence[Tag]) -> list[Link]:
    """Every wheel of the pin some target host can install (best first), else its sdist; all hash-pinned."""
    supported = {tag: rank for rank, tag in enumerate(tags)}
    wheels: dict[str, tuple[int, Link]] = {}
    sdists: dict[str, Link] = {}
    for link in links:
        # The sum first: a project's page lists thousands of files, and a set lookup spares parsing their names.
        if link.sha256 is not None and link.sha256.lower() not in pin.sha256s:
            continue  # another file (or another build of that version): pip would refuse it too
        parsed = _distribution(link.filename)
        if parsed is None or parsed[0] != pin.name or parsed[1] != Version(pin.version):
            continue
        if parsed[2] is None:
            sdists.setdefault(link.filename, link)
            continue
        ranks = [supported[tag] for tag in parsed[2] if tag in supported]
        if ranks:
            wheels.setdefault(link.filename, (min(ranks), link))
    if wheels:
        return [link for _, link in sorted(wheels.values(), key=lambda item: (item[0], item[1].filename))]
    return [next(iter(sorted(sdists.values(), key=lambda link: link.filename)))] if sdists else []


def hashed_downloads(
    pins: Sequence[Pinned],
    origin: str,
    python_version: str,
    index_urls: Sequence[str],
    find_links: Sequence[str],
    wheels_dir: Path,
    finder: LinkFinder,
) -> list[Download]:
    tags = supported_tags(python_version)
    downloads = []
    for pin in pins:
        if not marker_applies(pin.marker, python_version):
            continue
        chosen = choose_files(pin, finder.files(pin.name, index_urls, find_links), tags)
        if not chosen:
            sources = [*index_urls, *find_links] or ["no source at all"]
            raise FetchError(
                f"{origin}: no file of {pin.name}=={pin.version} with one of its pinned sha256 for Python"
                f" {python_version} on x86_64 Linux in {', '.join(sources)}"
            )
        downloads += [
            Download(f"{pin.name}=={pin.version}", link.url, wheels_dir / link.filename, pin.sha256s) for link in chosen
        ]
    return downloads


# -- the sources the env's pip calls read ----------------------------------------------------------------


def pip_source_options(pip: dict, extra_find_links: Sequence[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """(pip options, index URLs, find-links) of the env's pip.conf, as the pytorch role writes it."""
    index_urls = [] if pip["no_index"] else [u for u in [pip["index_url"], *pip["extra_index_urls"]] if u]
    find_links = [*pip["find_links"], *extra_find_links]
    for url in find_links:
        if not re.match(r"^https?://", url):
            raise FetchError(
                f"find-links {url!r} is not an http(s) URL: a directory on the hosts cannot be bundled from here"
            )
    options = ["--no-index"] if pip["no_index"] or not index_urls else ["--index-url", index_urls[0]]
    for url in index_urls[1:]:
        options += ["--extra-index-url", url]
    for url in find_links:
        options += ["--find-links", url]
    for url in [*index_urls, *find_links]:
        if urlsplit(url).scheme == "http":
            # pip ignores plain-HTTP sources unless told; an https source is always verified.
            options += ["--trusted-host", urlsplit(url).hostname]
    return options, index_urls, find_links


# -- git repositories of the pinned commits ------------------------------------------------------------


def _git(*args: str, cwd: Path | None = None) -> str:
    if shutil.which("git") is None:
        raise FetchError("git is not installed on this controller: run `make deps` (or install git)")
    # Certificates are always verified, whatever the user's git configuration says.
    command = ["git", "-c", "http.sslVerify=true", *args]
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env, check=False)
    if result.returncode != 0:
        raise FetchError(f"git {' '.join(args[:3])} failed (rc {result.returncode}): {result.stderr.strip()}")
    return result.stdout.strip()


def _resolve(repo: Path, ref: str) -> str | None:
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", cwd=repo)
    except FetchError:
        return None


@dataclass(frozen=True)
class RepoPin:
    name: str  # apex or verl: git/<name>.git
    url: str
    ref: str  # a commit, a tag or a branch
    commit: str | None  # the commit ref must be (None: whatever the tag says)

    def describe(self) -> str:
        pinned = f" (commit {self.commit})" if self.commit and self.commit != self.ref else ""
        return f"{self.name} {self.ref}{pinned}"


def _served_ref(repo: Path, ref: str) -> str | None:
    """The full name under which ref is kept in the served repository (a tag or a branch), None for a commit."""
    for prefix in ("refs/tags/", "refs/heads/"):
        if _resolve(repo, prefix + ref):
            return prefix + ref
    return None


def _repo_is_valid(served: Path, bundle: Path, pin: RepoPin) -> bool:
    if not (served / "HEAD").is_file() or not bundle.is_file():
        return False
    head = _resolve(served, PINNED_BRANCH)
    return head is not None and pin.commit in (None, head) and _resolve(served, pin.ref) == head


def bundle_repository(pin: RepoPin, out_dir: Path, console) -> str:
    """git/<name>.git (served as is) and git/<name>.bundle of the pinned commit's history: 'present' or 'cloned'."""
    git_dir = out_dir / GIT_DIR
    served, bundle = git_dir / f"{pin.name}.git", git_dir / f"{pin.name}.bundle"
    if _repo_is_valid(served, bundle, pin):
        return "present"
    git_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=git_dir, prefix=f".{pin.name}.partial-"))
    try:
        source = staging / "source.git"
        console.print(f"  cloning    {pin.url}", soft_wrap=True)
        _git("clone", "--bare", "--quiet", pin.url, str(source))
        commit = _resolve(source, pin.ref)
        if commit is None and re.fullmatch(r"[0-9a-f]{40}", pin.ref):
            # A pinned commit on no branch or tag: fetch it by id (servers that allow it).
            _git("fetch", "--quiet", "origin", f"{pin.ref}:{PINNED_BRANCH}", cwd=source)
            commit = _resolve(source, pin.ref)
        if commit is None:
            raise FetchError(f"{pin.describe()}: {pin.url} has no such commit, tag or branch. Fix the pin or the URL.")
        if pin.commit and commit != pin.commit:
            raise FetchError(
                f"{pin.describe()}: {pin.url} resolves {pin.ref} to commit {commit}, not the pinned {pin.commit}."
                " Refused: the repository is not the one the pin names."
            )
        refs = [PINNED_BRANCH]
        _git("update-ref", PINNED_BRANCH, commit, cwd=source)
        kept_ref = _served_ref(source, pin.ref)
        if kept_ref:
            refs.append(kept_ref)
        staged_bundle = staging / bundle.name
        _git("bundle", "create", str(staged_bundle), *refs, cwd=source)
        staged = staging / served.name
        _git("init", "--quiet", "--bare", str(staged))
        _git("fetch", "--quiet", str(staged_bundle), *[f"{ref}:{ref}" for ref in refs], cwd=staged)
        _git("symbolic-ref", "HEAD", PINNED_BRANCH, cwd=staged)
        # What a client of the plain-HTTP ("dumb") protocol reads: info/refs and objects/info/packs.
        _git("update-server-info", cwd=staged)
        if _resolve(staged, pin.ref) != commit:
            raise FetchError(f"{pin.describe()}: the repository made from the bundle lacks commit {commit}")
        os.replace(staged_bundle, bundle)
        if served.exists():
            old = staging / "replaced.git"
            os.replace(served, old)
        os.replace(staged, served)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return "cloned"


def repository_pins(pins: Sequence[HostPins]) -> list[RepoPin]:
    found: dict[str, RepoPin] = {}
    for host in pins:
        wanted = []
        if host.apex["enabled"]:
            wanted.append(RepoPin("apex", host.apex["repo"], host.apex["commit"], host.apex["commit"]))
        if host.verl["source"] == "git":
            expected = host.verl["expected_commit"]
            if not re.fullmatch(r"[0-9a-f]{40}", expected or ""):
                raise FetchError(
                    f"{host.host}: verl_expected_commit is {expected!r}: a bundle holds verl only at a pinned commit"
                    f" (the commit {host.verl['ref']} must be), never at whatever a tag says. Set it."
                )
            wanted.append(RepoPin("verl", host.verl["repo"], host.verl["ref"], expected))
        for pin in wanted:
            seen = found.setdefault(pin.name, pin)
            if seen != pin:
                raise FetchError(
                    f"{host.host}: {pin.describe()} from {pin.url}, but another host pins {seen.describe()} from"
                    f" {seen.url}. A bundle holds one {pin.name} repository: make the fleet's pins agree."
                )
    return list(found.values())


# -- the bundle -----------------------------------------------------------------------------------------


def bundle_downloads(pins: Sequence[HostPins], out_dir: Path, session: requests.Session) -> list[Download]:
    finder = LinkFinder(session)
    wheels = out_dir / WHEELS_DIR
    downloads = [
        Download(a.name, a.url, out_dir / a.file_name, frozenset({a.sha256}), a.size) for h in pins for a in h.artifacts
    ]
    resolved: set[tuple] = set()
    for host in pins:
        key = (host.python_version, json.dumps(host.pip, sort_keys=True), json.dumps(host.apex, sort_keys=True))
        key += (json.dumps(host.verl, sort_keys=True), tuple(host.torch_requirements))
        if key in resolved:
            continue
        resolved.add(key)
        torch_lock = host.torch_lock
        if not torch_lock.is_file():
            raise FetchError(
                f"{host.host}: the torch lock {torch_lock} does not exist (pytorch_lock_file): locks ship for Python"
                ' 3.10 and 3.11; for another, write one as README.md\'s "The torch lock" says'
            )
        # The torch install's own sources: the index and the extra indexes (PyPI), or the find-links.
        _, index_urls, find_links = pip_source_options(host.pip)
        locked = parse_hashed_requirements(torch_lock.read_text(), str(torch_lock))
        downloads += hashed_downloads(
            locked, str(torch_lock), host.python_version, index_urls, find_links, wheels, finder
        )
        lock = host.verl_lock
        if not lock.is_file():
            raise FetchError(f"{host.host}: the verl lock {lock} does not exist (verl_lock_file); run `make lock`")
        _, index_urls, find_links = pip_source_options(host.pip, host.verl["find_links"])
        locked = parse_hashed_requirements(lock.read_text(), str(lock))
        downloads += hashed_downloads(locked, str(lock), host.python_version, index_urls, find_links, wheels, finder)
        if host.apex["enabled"]:
            _, index_urls, find_links = pip_source_options(host.pip, host.apex["find_links"])
            tools = parse_hashed_requirements("\n".join(host.apex["build_requirements"]), "apex_build_requirements")
            origin = f"{host.host}: apex_build_requirements"
            downloads += hashed_downloads(tools, origin, host.python_version, index_urls, find_links, wheels, finder)
    return unique(downloads)


def write_wheel_index(wheels_dir: Path, downloads: Sequence[Download]) -> None:
    """wheels/index.html: the page pip reads as find-links (any static server serves it for wheels/)."""
    lines = ["<!DOCTYPE html>", "<html><head><title>p40fleet bundle: wheels</title></head><body>"]
    for path in sorted({d.dest for d in downloads if d.dest.parent == wheels_dir}):
        lines.append(f'<a href="{quote(path.name)}#sha256={sha256_of(path)}">{html.escape(path.name)}</a><br>')
    lines.append("</body></html>")
    _write_atomically(wheels_dir / "index.html", "\n".join(lines) + "\n")


def prune_wheels(wheels_dir: Path, downloads: Sequence[Download]) -> list[Path]:
    """Remove what an earlier bundle left in wheels/ that no pin wants any more (a wheel of an old lock)."""
    wanted = {d.dest for d in downloads} | {wheels_dir / "index.html"}
    stale = [p for p in wheels_dir.iterdir() if p.is_file() and p not in wanted] if wheels_dir.is_dir() else []
    for path in stale:
        path.unlink()
    return stale


def write_checksums(out_dir: Path, files: Iterable[Path]) -> Path:
    """SHA256SUMS: the bundle's own files (what else is in the directory is not the bundle's)."""
    entries = [f"{sha256_of(path)}  {path.relative_to(out_dir).as_posix()}" for path in sorted(set(files))]
    target = out_dir / "SHA256SUMS"
    _write_atomically(target, "\n".join(entries) + "\n")
    return target


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(path.name + ".partial")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


@dataclass
class BundleResult:
    out_dir: Path
    outcomes: list[Outcome]
    repositories: dict[str, str]
    notes: list[str]


def make_bundle(
    out_dir: Path | str,
    inventory: Path | str,
    limit: str | None = None,
    fetcher: Fetcher | None = None,
) -> BundleResult:
    out_dir = Path(out_dir).resolve()
    fetcher = fetcher or Fetcher()
    pins = read_pins(inventory, limit)
    out_dir.mkdir(parents=True, exist_ok=True)
    console = fetcher.console
    console.print(f"Bundling for {len(pins)} host(s) into {out_dir}")
    downloads = bundle_downloads(pins, out_dir, fetcher.session)
    outcomes = fetcher.fetch_all(downloads)
    for path in prune_wheels(out_dir / WHEELS_DIR, downloads):
        console.print(f"  {'removed':10} {path} (no pin wants it)", soft_wrap=True)
    write_wheel_index(out_dir / WHEELS_DIR, downloads)
    repositories = {pin.name: bundle_repository(pin, out_dir, console) for pin in repository_pins(pins)}
    for name, state in repositories.items():
        console.print(f"  {state:10} {out_dir / GIT_DIR / name}.git", soft_wrap=True)
    files = [d.dest for d in downloads] + [out_dir / WHEELS_DIR / "index.html"]
    files += [out_dir / GIT_DIR / f"{name}.bundle" for name in repositories]
    write_checksums(out_dir, files)
    notes = []
    if any(host.verl["install_vllm"] for host in pins):
        notes.append("vLLM is not bundled (verl_install_vllm): it has no sha256 pin, and the verl role refuses it.")
    return BundleResult(out_dir, outcomes, repositories, notes)
