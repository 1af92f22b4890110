#!/usr/bin/env bash
# The full test command (README's second command, run by .ci/run).
# Installs what the tests need on a fresh Debian 12 machine, then runs format check, clippy
# and every test. Safe to re-run: installed packages are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

# --- system packages the tests use ---------------------------------------------------------
# util-linux: setpriv/prlimit (memlock tests drop CAP_IPC_LOCK in a child process)
# iproute2: network namespaces for two-host tests
# tshark: wire conformance (RoCEv2 decode with Wireshark's InfiniBand dissector)
# libibverbs-dev, ibverbs-utils, perftest, python3-pyverbs: the drop-in libibverbs tests
# bpftrace: the USDT probe test (crates/mrkit-ibverbs/tests/monitoring.rs)
# libucx-dev: UCX's rcache beside the cache in `mrkit bench pool-cache` (its C program is built
#   and run by the bench tests; without it they skip those keys, loudly)
PKGS=(util-linux iproute2 gcc pkg-config tshark libibverbs-dev ibverbs-utils perftest python3-pyverbs bpftrace libucx-dev)
missing=()
for p in "${PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "==> installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# As root (CI) the capture and network-namespace tests must run, not skip.
if [ "$(id -u)" -eq 0 ]; then
  export MRKIT_REQUIRE_TSHARK=1 MRKIT_REQUIRE_NETNS=1
fi

# --- Rust checks ---------------------------------------------------------------------------
# The optional tokio feature of mrkit (async completions) is built, linted and tested too.
FEATURES=(--features mrkit/tokio)
echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets "${FEATURES[@]}" -- -D warnings
echo "==> cargo doc -D warnings (broken or private intra-doc links)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet "${FEATURES[@]}"
echo "==> cargo test"
cargo test --workspace --all-targets "${FEATURES[@]}" -- --test-threads=2
cargo test --workspace --doc "${FEATURES[@]}"
./scripts/second-provider.sh "${FEATURES[@]}"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p mrkit --profile loom --test loom_pool --test loom_cache
echo "==> fuzzing (bounded): packet parser, responder and completer"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install -q cargo-fuzz --locked
# `-s none` builds without sanitizers, which works on the stable toolchain.
(cd fuzz && cargo fuzz run -s none wire_parse -- -max_total_time=20 -print_final_stats=1 2>&1 | tail -3)
(cd fuzz && cargo fuzz run -s none responder -- -max_total_time=20 -print_final_stats=1 2>&1 | tail -3)
(cd fuzz && cargo fuzz run -s none completer -- -max_total_time=20 -print_final_stats=1 2>&1 | tail -3)
# The binaries of the test build above, run directly: `cargo run -p <one package>` would
# resolve the workspace's features for that package alone and rebuild tokio, mrkit and the
# CLI (about a minute on the CI machine) to run the same code.
echo "==> CLI smoke"
cargo build -q --workspace --bins --examples "${FEATURES[@]}"
BIN="$(cd "${CARGO_TARGET_DIR:-target}" && pwd)/debug"
"$BIN/mrkit" demo >/dev/null
echo "==> examples (each checks its own results)"
for ex in kv_get pool_echo storage_cache async_echo; do
  echo "    $ex"
  "$BIN/examples/$ex" >/dev/null
  # Again on the rdma-core provider over the drop-in (the examples open MRKIT_DEVICE).
  MRKIT_DEVICE=rdma-core:mrkit0 MRKIT_RDMA_CORE_LIB="$BIN/deps/libibverbs.so" "$BIN/examples/$ex" >/dev/null
done
echo "all tests passed"
