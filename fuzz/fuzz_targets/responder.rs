//! Fuzz target: arbitrary datagrams into a live RC responder (receive path, PSN/opcode
//! checks, rkey checks, memory copies, atomics, NAK/ACK generation). The body lives in the
//! library (`mrkit_soft::fuzz::fuzz_responder`) and asserts that no byte outside the
//! registered buffer changes and that progress converges.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    mrkit_soft::fuzz::fuzz_responder(data);
});
