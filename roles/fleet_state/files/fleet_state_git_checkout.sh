# A checkout at a pinned ref, made by the env owner in its own directory (fleet_state_owner_run runs it as
# `bash -c <this> checkout REPO DEST REF FORCE`): what ansible.builtin.git did, without a module in the owner's
# Python. Prints before=<commit> and after=<commit>; root only compares them with the commit it pinned.
set -euo pipefail
repo=$1 dest=$2 ref=$3 force=$4
export GIT_TERMINAL_PROMPT=0
cloned=no
if [ ! -e "$dest/.git" ]; then
  git clone --quiet --no-checkout -- "$repo" "$dest"
  cloned=yes
fi
cd -- "$dest"
# A clone made just now has no work tree yet: nothing was checked out before, and nothing is modified.
before=""
if [ "$cloned" = no ]; then
  before=$(git rev-parse -q --verify 'HEAD^{commit}' || true)
fi
if [ "$force" != yes ] && [ -n "$before" ] && [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "Local modifications exist in the destination: $dest" >&2
  exit 1
fi
git fetch --quiet --force --tags origin '+refs/heads/*:refs/remotes/origin/*'
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
