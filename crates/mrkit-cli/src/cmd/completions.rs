//! `mrkit completions SHELL`: shell completion scripts (clap_complete).

use clap::{Args, CommandFactory};
use clap_complete::Shell;

use crate::exit;

#[derive(Args, Debug)]
#[command(
    after_help = "Examples:\n  mrkit completions bash > /etc/bash_completion.d/mrkit\n  mrkit completions zsh > \"${fpath[1]}/_mrkit\"\n  mrkit completions fish > ~/.config/fish/completions/mrkit.fish"
)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    shell: Shell,
}

pub fn run(a: CompletionsArgs) -> u8 {
    let mut cmd = crate::Cli::command();
    clap_complete::generate(a.shell, &mut cmd, "mrkit", &mut std::io::stdout());
    exit::OK
}
