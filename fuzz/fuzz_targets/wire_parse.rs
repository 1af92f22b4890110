//! Fuzz target: RoCEv2 packet parsing, re-building and ICRC invariants.
//! The body lives in the library (`mrkit_soft::wire::fuzz_parse`) so that stable-toolchain
//! unit tests drive the same code with proptest.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mrkit_soft::wire::fuzz_parse(data);
});
