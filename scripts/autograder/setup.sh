#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu, Python 3.11 or later):
# bubblewrap for the sandbox, then the course's packages from its lock file.
set -euo pipefail
apt-get update -qq
apt-get install -y -qq bubblewrap
cd /autograder/source/course
python3 -m pip install --quiet 'pdm[locked]'
PDM_CHECK_UPDATE=false pdm install --frozen-lockfile --prod
