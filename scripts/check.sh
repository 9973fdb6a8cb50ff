#!/bin/sh
# The whole test suite, as CI runs it: luacheck (make lint), the specs
# plainly and under ASan+UBSan, then a short fuzz run of the decoder.  Ends with one line
# "N passed, N failed" that counts every spec of both runs.
set -u
cd "$(dirname "$0")/.."

sh scripts/install-deps.sh || exit 1

log=$(mktemp -d "${TMPDIR:-/tmp}/mpcheck.XXXXXX")
trap 'rm -rf "$log"' EXIT
status=0

for target in test check-asan; do
  echo "==> make $target"
  if ! make --no-print-directory "$target" > "$log/$target.out" 2>&1; then
    status=1
  fi
  cat "$log/$target.out"
done

echo "==> make lint"
# counted as one more check in the summary line
if make --no-print-directory lint; then
  echo "SUMMARY 1 0" > "$log/lint.out"
else
  echo "SUMMARY 0 1" > "$log/lint.out"
  status=1
fi

echo "==> make fuzz"
make --no-print-directory fuzz || status=1

# Each busted run printed "SUMMARY <passed> <failed>".
awk '/^SUMMARY [0-9]+ [0-9]+$/ { p += $2; f += $3; runs++ }
     END { if (runs < 3) f += 1; printf "%d passed, %d failed\n", p, f }' \
    "$log/test.out" "$log/check-asan.out" "$log/lint.out" > "$log/summary"
[ "$(cut -d' ' -f3 "$log/summary")" = 0 ] || status=1
cat "$log/summary"
exit $status
