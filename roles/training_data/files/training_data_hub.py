"""training_data's hub downloads, in root's Python (/usr/bin/python3 -I), standard library only.

usage: training_data_hub.py list ENDPOINT CA KIND REPO COMMIT           (as the throwaway account; token on stdin)
       training_data_hub.py get ENDPOINT CA KIND REPO COMMIT PATH SIZE  (as the throwaway account; token on stdin)
       training_data_hub.py verify STAGE_DIR FILES_JSON                 (as root, after the account is gone)

list prints the hub's listing of REPO at COMMIT with each file's hashes (?blobs=true); get writes one file's bytes
on stdout (root's module puts them in root's staging directory), at most SIZE of them. The token goes only to the
endpoint's own host (a redirect to a CDN is followed without it), over verified TLS (the system's CAs, and CA: PEM
text of a private mirror's CA, or empty); plain http only to a loopback host. verify recomputes each staged file's
hash (LFS sha256, or the git blob sha1 of `blob <size>\\0<bytes>`) against FILES_JSON (the listing's files that
plugins/filter/training_data.py chose), removes any that differs, and makes the good ones readable for the owner's
copy. Errors go to stderr and exit 1.
"""

import hashlib
import ipaddress
import json
import os
import ssl
import stat
import sys
import urllib.error
import urllib.parse
import urllib.request

REDIRECTS = (301, 302, 303, 307, 308)
MAX_REDIRECTS = 10
CHUNK = 1 << 20


class Refused(Exception):
    pass


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """Redirects come back as errors: each hop is judged here, and the token never follows one to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def opener(ca):
    context = ssl.create_default_context()
    if ca:
        context.load_verify_locations(cadata=ca)
    return urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context), NoRedirect()
    )


def loopback(host):
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url):
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https" or (parts.scheme == "http" and loopback(parts.hostname or "")):
        return (parts.scheme, (parts.hostname or "").lower(), parts.port or (443 if parts.scheme == "https" else 80))
    raise Refused(f"{url}: only https (plain http to a loopback host alone) is used")


def open_url(endpoint, ca, url, token):
    """The response for url, redirects followed by hand; Authorization only towards the endpoint's origin."""
    home, client = origin(endpoint), opener(ca)
    for _ in range(MAX_REDIRECTS + 1):
        headers = {"User-Agent": "p40fleet-training-data"}
        if token and origin(url) == home:
            headers["Authorization"] = f"Bearer {token}"
        try:
            return client.open(urllib.request.Request(url, headers=headers), timeout=60)
        except urllib.error.HTTPError as error:
            location = error.headers.get("Location")
            if error.code not in REDIRECTS or not location:
                detail = error.headers.get("X-Error-Message") or error.read(300).decode("utf-8", "replace")
                code = error.headers.get("X-Error-Code") or ""
                raise Refused(f"{url}: HTTP {error.code} {code} {detail}".strip()) from None
            url = urllib.parse.urljoin(url, location)
    raise Refused(f"{url}: more than {MAX_REDIRECTS} redirects")


def repo_path(kind, repo):
    return ("datasets/" if kind == "dataset" else "") + repo


def listing(endpoint, ca, kind, repo, commit, token):
    url = f"{endpoint.rstrip('/')}/api/{kind}s/{repo}/revision/{commit}?blobs=true"
    with open_url(endpoint, ca, url, token) as response:
        document = json.loads(response.read())
    print(json.dumps(document))


def get(endpoint, ca, kind, repo, commit, path, size, token):
    quoted = urllib.parse.quote(path)
    url = f"{endpoint.rstrip('/')}/{repo_path(kind, repo)}/resolve/{commit}/{quoted}"
    written, out = 0, sys.stdout.buffer
    with open_url(endpoint, ca, url, token) as response:
        for block in iter(lambda: response.read(CHUNK), b""):
            written += len(block)
            if written > size:
                raise Refused(f"{url}: more than the {size} bytes the listing gives")
            out.write(block)
    out.flush()


def digest(handle, kind, size):
    hasher = hashlib.sha256() if kind == "sha256" else hashlib.sha1(b"blob %d\0" % size)
    for block in iter(lambda: handle.read(CHUNK), b""):
        hasher.update(block)
    return hasher.hexdigest()


def verify(stage_dir, files):
    """Each staged file against its listed hash and size; a bad one is removed and the whole fetch refused."""
    bad = []
    for entry in files:
        path = os.path.join(stage_dir, entry["dest"])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as error:
            bad.append(f"{entry['dest']}: {error.strerror}")
            continue
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != 0:
                bad.append(f"{entry['dest']}: not a regular file of root's")
                continue
            found = digest(handle, entry["hash"], info.st_size) if info.st_size == entry["size"] else None
            if found != entry["digest"]:
                why = f"{entry['hash']} {found}" if found else f"{info.st_size} bytes, listed {entry['size']}"
                bad.append(f"{entry['dest']}: {why}, the hub lists {entry['hash']} {entry['digest']}")
                os.unlink(path)
                continue
            os.fchmod(handle.fileno(), 0o644)
    if bad:
        raise Refused("staged files differ from the hub's listing at the pinned commit: " + "; ".join(bad))
    print(json.dumps({"verified": len(files)}))


def main(argv):
    action = argv[1]
    try:
        if action == "verify":
            verify(argv[2], json.loads(argv[3]))
            return 0
        token = sys.stdin.readline().strip()
        endpoint, ca, kind, repo, commit = argv[2:7]
        if action == "list":
            listing(endpoint, ca, kind, repo, commit, token)
        elif action == "get":
            get(endpoint, ca, kind, repo, commit, argv[7], int(argv[8]), token)
        else:
            raise Refused(f"unknown action {action}")
    except (Refused, OSError, ValueError, ssl.SSLError) as error:
        print(f"training_data_hub {action}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
