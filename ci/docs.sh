#!/usr/bin/env bash
# The documentation site (MkDocs + mkdocs-material + mkdocstrings; mkdocs.yml): sets up .venv
# with the `docs` extra, checks that the API reference has an entry with a docstring for every
# name of gpumem.__all__ (tests/test_api_reference.py), then builds the site with warnings as
# errors (--strict: a broken link or anchor, a page missing from the nav, a reference that does
# not resolve) into site/. Open site/index.html, or `mkdocs serve` for a live preview.
# Nothing is fetched at build time beyond the PyPI installs (the theme's web fonts are loaded
# by the browser that views the site).
set -euo pipefail
cd "$(dirname "$0")/.."
# set up only where .venv lacks what the build needs (ci/test.sh installs the docs extra too,
# so in .ci/run this reuses its venv instead of building gpumem a second time)
VENV="${GPUMEM_VENV:-.venv}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import gpumem._core.pool, mkdocs, \
        material, mkdocstrings_handlers.python, griffe, pytest" 2>/dev/null; then
    . "$VENV/bin/activate"
else
    source ci/setup_env.sh "docs,test"
fi
python -m pytest -q -p no:cacheprovider tests/test_api_reference.py
export NO_MKDOCS_2_WARNING=1        # mkdocs-material's banner about its successor: not a finding
python -m mkdocs build --strict --site-dir site
echo "docs: site/index.html ($(find site -name '*.html' | wc -l) pages)"
