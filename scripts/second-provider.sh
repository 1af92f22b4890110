#!/usr/bin/env bash
# The mrkit API, pool and cache suites and the CLI tests a second time, on the rdma-core
# provider over the project's drop-in libibverbs (mrkit API -> rdma-core provider -> C ABI ->
# drop-in -> its own mrkit0): the same test binaries, with MRKIT_DEVICE=rdma-core:mrkit0.
# Run by scripts/test.sh after the first (native) pass; arguments are passed to cargo test
# (features). Prints each binary's time and how many of its tests said they need the native
# mrkit0 (needs_native: a loud "MRKIT-SKIP" line each), and fails when a test fails.
# By hand: ./scripts/second-provider.sh [--features mrkit/tokio] [TEST_BINARY...]
set -euo pipefail
cd "$(dirname "$0")/.."

FEATURES=()
ONLY=()
while (($#)); do
  case "$1" in
    --features) FEATURES+=("$1" "$2"); shift 2 ;;
    --features=*) FEATURES+=("$1"); shift ;;
    *) ONLY+=("$1"); shift ;;
  esac
done

TARGET="${CARGO_TARGET_DIR:-target}"
mkdir -p "$TARGET"
TARGET="$(cd "$TARGET" && pwd)"
# Built by cargo next to the test binaries (mrkit-ibverbs is a dev-dependency of mrkit).
DROPIN="$TARGET/debug/deps/libibverbs.so"

# Every test binary of crates/mrkit and crates/mrkit-cli, except those that already run both
# providers side by side in one process (rdma_core*, query_port, provider_rules), those that
# name the rdma-core device themselves (bench_device: `--device rdma-core:mrkit0` in both
# passes, ~2 minutes each), the loom models (no device) and the CLI's perf tests (a perf
# helper's; tests/rdma_core.rs runs `mrkit perf` on both).
# The binaries of the first pass are reused (the same cargo command and features: another
# feature set would rebuild the drop-in), run directly in their package's directory as
# `cargo test` does.
echo "==> the suites again on rdma-core:mrkit0 (the drop-in through the rdma-core provider)"
LOG="$(mktemp -d)"
trap 'rm -rf "$LOG"' EXIT
cargo test -q --workspace "${FEATURES[@]}" --tests --no-run --message-format=json >"$LOG/build.json"
[ -e "$DROPIN" ] || { echo "missing $DROPIN (the drop-in's cdylib)"; exit 1; }
ROOT="$(pwd)"
total=0 skipped=0 failed=()
t_all=$(date +%s%N)
while read -r src exe; do
  dir="${src%/tests/*}" name="$(basename "$src" .rs)"
  crate="$(basename "$dir")"
  case "$dir" in "$ROOT/crates/mrkit" | "$ROOT/crates/mrkit-cli") ;; *) continue ;; esac
  case "$name" in rdma_core* | query_port | provider_rules | bench_device | loom_* | perf*) continue ;; esac
  if ((${#ONLY[@]})) && [[ ! " ${ONLY[*]} " == *" $name "* ]]; then continue; fi
  t0=$(date +%s%N)
  rc=0
  (cd "$dir" && MRKIT_DEVICE=rdma-core:mrkit0 MRKIT_RDMA_CORE_LIB="$DROPIN" \
    "$exe" --test-threads=2) >"$LOG/$name" 2>&1 || rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  # Not anchored: libtest's progress dots (stdout) may precede a line on the same row.
  n=$({ grep -o 'MRKIT-SKIP \[' "$LOG/$name" || true; } | wc -l)
  ran=$(sed -n 's/^test result: .* \([0-9]*\) passed.*/\1/p' "$LOG/$name" | tail -1)
  printf '    %-10s %-24s %6d ms  %3s passed  %2d checks need the native mrkit0\n' \
    "$crate" "$name" "$ms" "${ran:-?}" "$n"
  grep -o 'MRKIT-SKIP \[.*' "$LOG/$name" | sed 's/^/        /' || true
  skipped=$((skipped + n))
  total=$((total + ms))
  if ((rc)); then
    failed+=("$crate/$name")
    cat "$LOG/$name"
  fi
done < <(sed -n 's/.*"src_path":"\([^"]*\/tests\/[^"/]*\.rs\)".*"executable":"\([^"]*\)".*/\1 \2/p' "$LOG/build.json" | sort -u)
echo "    second pass: $(((($(date +%s%N) - t_all) / 1000000))) ms in all (tests $total ms), $skipped checks need the native mrkit0 (MRKIT-SKIP lines)"
if ((${#failed[@]})); then
  echo "FAILED on rdma-core:mrkit0: ${failed[*]}"
  exit 1
fi
