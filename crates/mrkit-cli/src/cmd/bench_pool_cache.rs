//! `mrkit bench pool-cache` (filled in with the registration services).

/// Run the pool/cache benchmark; `json` selects JSON output.
#[allow(dead_code)] // wired to `mrkit bench pool-cache` by the tools work
pub fn run(_json: bool) -> u8 {
    eprintln!("mrkit bench pool-cache: not implemented yet");
    crate::exit::USAGE
}
