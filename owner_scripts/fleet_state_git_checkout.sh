# A checkout at a pinned ref, made in the running account's own directory (fleet_state_owner_run runs it as
# `bash -c <this> checkout REPO DEST REF FORCE [ORIGIN]`): what ansible.builtin.git did, without a module in the
# owner's Python. Prints before=<commit> and after=<commit>; root only compares them with the commit it pinned.
# ORIGIN (default REPO) is the URL the checkout keeps as origin: verl's owner fetches from a bundle root staged
# (REPO) and keeps the upstream URL.
# REPO carries no credentials: an http(s) URL's user and password come as two lines on stdin
# (plugins/filter/fleet_state.py), reach git through a credential helper's environment, and are in no command
# line (`ps` shows those to every account) and no file (.git/config keeps REPO as given).
set -euo pipefail
repo=$1 dest=$2 ref=$3 force=$4 origin=${5:-$1}
export GIT_TERMINAL_PROMPT=0
IFS= read -r username || true
IFS= read -r password || true
# The helper's text names the variables, never their values.
helper='!f() { test "$1" = get && printf "username=%s\npassword=%s\n" "$P40FLEET_GIT_USERNAME" "$P40FLEET_GIT_PASSWORD"; }; f'
remote_git() {
  if [ -n "$username$password" ]; then
    P40FLEET_GIT_USERNAME=$username P40FLEET_GIT_PASSWORD=$password \
      git -c credential.helper= -c "credential.helper=$helper" "$@"
  else
    git "$@"
  fi
}
cloned=no
if [ ! -e "$dest/.git" ]; then
  remote_git clone --quiet --no-checkout -- "$repo" "$dest"
  cloned=yes
fi
cd -- "$dest"
# An earlier clone's URL may have carried credentials (or named another repository): origin is ORIGIN now.
git remote set-url origin "$origin"
# A clone made just now has no work tree yet: nothing was checked out before, and nothing is modified.
before=""
if [ "$cloned" = no ]; then
  before=$(git rev-parse -q --verify 'HEAD^{commit}' || true)
fi
if [ "$force" != yes ] && [ -n "$before" ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "Local modifications exist in the destination: $dest" >&2
  exit 1
fi
remote_git fetch --quiet --force --tags -- "$repo" '+refs/heads/*:refs/remotes/origin/*'
commit=$(git rev-parse -q --verify "$ref^{commit}" || git rev-parse -q --verify "origin/$ref^{commit}") || {
  echo "$ref is no commit, tag or branch of $repo" >&2
  exit 1
}
if [ "$force" = yes ]; then
  git checkout --quiet --force --detach "$commit"
else
  git checkout --quiet --detach "$commit"
fi
echo "before=$before"
echo "after=$(git rev-parse HEAD)"
