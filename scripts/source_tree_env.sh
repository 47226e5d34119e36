# Sourced by the GPU scripts: makes `import onegraph` work from the source tree without an
# install (the package's source is runtime/, installed under the name onegraph).
# Sets ROOT (the repository) and PYTHONPATH.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_og_path=${TMPDIR:-/tmp}/onegraph-source-$$
mkdir -p "$_og_path" && ln -sfn "$ROOT/runtime" "$_og_path/onegraph"
export PYTHONPATH="$ROOT:$_og_path${PYTHONPATH:+:$PYTHONPATH}"
