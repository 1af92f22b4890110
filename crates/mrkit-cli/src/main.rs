//! `mrkit`: the command an RDMA engineer runs first.
#![forbid(unsafe_code)]

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes scripts can rely on.
pub mod exit {
    /// Success.
    pub const OK: u8 = 0;
    /// The verb failed (the errno is printed).
    pub const VERB_FAILED: u8 = 1;
    /// Bad command line or environment.
    pub const USAGE: u8 = 2;
}

#[derive(Parser, Debug)]
#[command(
    name = "mrkit",
    version,
    about = "RDMA memory registration done right, on the embedded software device mrkit0",
    after_help = "Examples:\n  mrkit demo\n  mrkit reg --size 8MiB --access local-write,remote-write --json\n  MRKIT_MAX_MR=1000 mrkit reg --size 4096 --access remote-read"
)]
struct Cli {
    /// More logging (-v info, -vv debug, -vvv trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Allocate a buffer, register it on mrkit0 and print the keys and translation.
    Reg(cmd::reg::RegArgs),
    /// A guided tour: keys, translation, the classic mistakes and their real errors.
    Demo(cmd::demo::DemoArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let level = match cli.verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MRKIT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .init();
    let code = match cli.cmd {
        Command::Reg(a) => cmd::reg::run(a),
        Command::Demo(a) => cmd::demo::run(a),
    };
    ExitCode::from(code)
}
