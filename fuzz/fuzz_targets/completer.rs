//! Fuzz target: arbitrary responses (ACK/NAK/RNR NAK, READ responses, atomic ACKs, garbage)
//! and retransmission timeouts into a requester with SEND/WRITE/READ/atomic WQEs outstanding.
//! The body lives in the library (`mrkit_soft::fuzz::fuzz_completer`) and asserts that
//! no completion is reported twice or out of order, that progress converges, and that READ
//! data and atomic results land only inside the local buffer.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = mrkit_soft::fuzz::fuzz_completer(data);
});
