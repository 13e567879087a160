#!/usr/bin/env bash
# CUDA compiler launcher: runs the compile command unchanged and keeps ptxas' -v report in
# <object>.ptxas.log (read later by tools/ptxas_check.py). ptxas' "info" lines go only to the
# log; everything else (warnings, errors) is still shown on the console.
out=""
prev=""
for a in "$@"; do
  if [ "$prev" = "-o" ]; then out="$a"; fi
  prev="$a"
done
if [ -z "$out" ]; then exec "$@"; fi
log="${out}.ptxas.log"
mkdir -p "$(dirname "$log")"
"$@" 2> "$log.tmp"
rc=$?
grep -v -E '^(ptxas info|    [0-9]+ bytes stack frame|ptxas info    : )' "$log.tmp" >&2
mv "$log.tmp" "$log"
exit $rc
