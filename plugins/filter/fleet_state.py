"""fleet_state's split of a git URL into what may be shown and what must stay secret.

`url | fleet_state_git_remote(host)` gives {"url": the URL without its credentials, "stdin": the credentials as
two lines (user, password) or ""}. roles/fleet_state/files/fleet_state_git_checkout.sh takes the URL on its command
line and the credentials on its stdin, for a credential helper: `ps` shows a command line to every account, and
git keeps the clone's URL in the checkout's .git/config, which others can read. Unit-tested in
python/tests/test_git_credentials.py.
"""

from urllib.parse import unquote, urlsplit, urlunsplit

from ansible.errors import AnsibleFilterError

# Only git's HTTP transports read a user and password; an ssh URL's user is a login name, not a secret.
HTTP = ("http", "https")


def fleet_state_git_remote(url, host="this host"):
    """The URL to clone from, with any user:password@ of an http(s) URL moved to the credential lines."""
    text = str(url)
    try:
        parts = urlsplit(text)
        user, password = parts.username, parts.password
    except ValueError as error:
        raise AnsibleFilterError(f"{host}: the git URL cannot be read ({error}). Required: a URL git clones.") from None
    if "@" not in parts.netloc or "://" not in text:
        return {"url": text, "stdin": ""}
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    if parts.scheme.lower() not in HTTP:
        if password is not None:
            # The message shows the URL without its credentials: it is printed on the operator's terminal.
            raise AnsibleFilterError(
                f"{host}: the git URL {bare} carries a password, which git reads only over http(s). Required: "
                "no password in the URL (ssh authenticates with a key)."
            )
        return {"url": text, "stdin": ""}
    user, password = unquote(user or ""), unquote(password or "")
    if any(ch in user + password for ch in "\r\n\0"):
        raise AnsibleFilterError(
            f"{host}: the credentials of the git URL {bare} hold a line break or NUL, which git's credential "
            "protocol cannot carry. Required: a user and password without them."
        )
    return {"url": bare, "stdin": f"{user}\n{password}\n"}


class FilterModule:
    def filters(self):
        return {"fleet_state_git_remote": fleet_state_git_remote}
