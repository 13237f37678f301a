"""fleet_state's split of a git URL into what may be shown and what must stay secret.

`url | fleet_state_git_remote(host)` gives {"url": the URL without its credentials, "stdin": the credentials as
two lines (user, password) or ""}. owner_scripts/fleet_state_git_checkout.sh takes the URL on its command
line and the credentials on its stdin, for a credential helper: `ps` shows a command line to every account, and
git keeps the clone's URL in the checkout's .git/config, which others can read. Unit-tested in
python/tests/test_git_credentials.py.

`passwd_entry | fleet_state_throwaway_found(account, env_owner, comment, variable, purpose, host)` says whether
the throwaway account of tasks/throwaway_account.yml (apex's build, verl's clone) is "absent" or "ours" (left by an
interrupted run), refusing any other account of that name. Unit-tested in python/tests/test_apex_rules.py.
"""

import re
from urllib.parse import unquote, urlsplit, urlunsplit

from ansible.errors import AnsibleFilterError

# Only git's HTTP transports read a user and password; an ssh URL's user is a login name, not a secret.
HTTP = ("http", "https")
# A plain account name (useradd's portable set); no path, no option.
ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
NOLOGIN = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false", "/usr/bin/false")


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


def fleet_state_throwaway_found(passwd_entry, account, env_owner, comment, variable, purpose, host="this host"):
    """absent, or ours (a leftover of an interrupted run: removed and made again); any other account is refused."""
    if not isinstance(account, str) or not ACCOUNT.fullmatch(account) or account in ("root", env_owner):
        raise AnsibleFilterError(
            f"{host}: {variable} is {account!r}. Required: a plain account name of its own, neither root nor "
            f"the env owner {env_owner}: root makes it for {purpose} and removes it after."
        )
    if not passwd_entry:
        return "absent"
    fields = list(passwd_entry)
    if len(fields) >= 6 and fields[3] == comment and fields[5] in NOLOGIN:
        return "ours"
    raise AnsibleFilterError(
        f"{host}: an account {account} exists (comment {fields[3:4]}, shell {fields[5:6]}) that p40fleet did not make "
        f"for {purpose} ({comment!r}, no login shell); p40fleet removes its throwaway account after each use. "
        f"Set {variable} to a name no one uses."
    )


class FilterModule:
    def filters(self):
        return {
            "fleet_state_git_remote": fleet_state_git_remote,
            "fleet_state_throwaway_found": fleet_state_throwaway_found,
        }
