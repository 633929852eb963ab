#!/usr/bin/env bash
# For a device call made while other work is uncommitted in this checkout (e.g. a helper's):
# writes gpu_restore/ — HEAD's version of every modified tracked file, and the list of untracked
# files. It is untracked and not ignored, so the device tool copies it; on the device,
#   cp -r gpu_restore/head/. . && rm -f $(cat gpu_restore/untracked.txt) && rm -rf gpu_restore
# turns the copy back into HEAD. (The device copy's .git is not this checkout's: git there shows
# an older commit, so `git stash`/`git checkout` on the device would roll the code back.)
# Delete gpu_restore/ here after the call.
set -eu
rm -rf gpu_restore && mkdir -p gpu_restore/head
git status --short | awk '$1=="M"{print $2}' > gpu_restore/modified.txt
git status --short | awk '$1=="??"{print $2}' | grep -v '^gpu_restore' > gpu_restore/untracked.txt || true
for f in $(cat gpu_restore/modified.txt); do
  mkdir -p "gpu_restore/head/$(dirname "$f")"; git show "HEAD:$f" > "gpu_restore/head/$f"
done
echo "restore set: $(wc -l < gpu_restore/modified.txt) modified, $(wc -l < gpu_restore/untracked.txt) untracked"
