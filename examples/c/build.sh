#!/bin/sh
# Build the C example against the library (python build.py makes runtime/_lib/libonegraph.so).
#   examples/c/build.sh [OUTPUT]      default OUTPUT: examples/c/og_decode
# The rpath names the library folder both relative to the default output and absolutely, so
# the program also runs from another OUTPUT without LD_LIBRARY_PATH.
set -eu
cd "$(dirname "$0")/../.."
out=${1:-examples/c/og_decode}
lib_dir=${ONEGRAPH_LIB_DIR:-$PWD/runtime/_lib}
${CC:-gcc} -std=c11 -O2 -Wall -Wextra -o "$out" examples/c/decode.c -I cuda -L "$lib_dir" -lonegraph \
    -Wl,-rpath,'$ORIGIN/../../runtime/_lib' -Wl,-rpath,"$lib_dir"
echo "$out"
