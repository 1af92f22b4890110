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

/// Standard output for the commands: a closed reader (`mrkit devinfo --json | head -1`) ends the
/// process quietly with status 0 instead of a "Broken pipe" panic.
pub mod out {
    use std::io::{self, Write};

    /// Leave now: the reader of our standard output has gone.
    pub fn broken_pipe() -> ! {
        mrkit::stat_export::shutdown();
        std::process::exit(i32::from(crate::exit::OK))
    }

    /// Write formatted text to a locked stdout; `ErrorKind::BrokenPipe` exits with status 0,
    /// other write errors are reported once on stderr and exit with status 1.
    pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
        let mut o = io::stdout().lock();
        let r = o
            .write_fmt(args)
            .and_then(|()| if newline { o.write_all(b"\n") } else { Ok(()) });
        if let Err(e) = r {
            drop(o);
            fail(e);
        }
    }

    /// Flush stdout with the same error handling as [`write()`].
    pub fn flush() {
        if let Err(e) = io::stdout().lock().flush() {
            fail(e);
        }
    }

    fn fail(e: io::Error) -> ! {
        if e.kind() == io::ErrorKind::BrokenPipe {
            broken_pipe();
        }
        eprintln!("mrkit: cannot write to standard output: {e}");
        mrkit::stat_export::shutdown();
        std::process::exit(i32::from(crate::exit::VERB_FAILED))
    }

    /// The same guarantee for output still written with `println!` (whose error is a panic with
    /// the message "failed printing to stdout: Broken pipe ..."): exit 0 quietly; every other
    /// panic goes to the default hook.
    pub fn install_panic_hook() {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let msg = info
                .payload()
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| info.payload().downcast_ref::<&str>().copied())
                .unwrap_or("");
            // println! and clap_complete's generator (`mrkit completions`).
            let stdout_write = msg.starts_with("failed printing to stdout")
                || msg.starts_with("failed to write completion file");
            if stdout_write && (msg.contains("Broken pipe") || msg.contains("os error 32")) {
                broken_pipe();
            }
            default(info);
        }));
    }
}

/// `println!` through [`out::write`] (broken pipe = quiet exit 0).
#[macro_export]
macro_rules! outln {
    () => { $crate::out::write(format_args!(""), true) };
    ($($t:tt)*) => { $crate::out::write(format_args!($($t)*), true) };
}

/// `print!` through [`out::write`].
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::write(format_args!($($t)*), false) };
}

#[derive(Parser, Debug)]
#[command(
    name = "mrkit",
    version,
    about = "RDMA memory registration done right, on the embedded software device mrkit0 or any RDMA device (--device NAME)",
    after_help = "Examples:\n  mrkit demo\n  mrkit devinfo -v\n  mrkit capacity\n  mrkit doctor\n  mrkit doctor explain EINVAL --access remote-write\n  mrkit reg --size 8MiB --access local-write,remote-write --json\n  mrkit stat --watch 1\n  mrkit bench --quick\n  mrkit devinfo --list\n  mrkit devinfo -v --device rdma-core:mlx5_0\n  MRKIT_MAX_MR=1000 mrkit reg --size 4096 --access remote-read\n\nExit status: 0 ok, 1 the verb or a check failed (also: an unknown device, rdma-core missing), 2 usage error (bad arguments or MRKIT_* environment)."
)]
pub(crate) struct Cli {
    /// More logging (-v info, -vv debug, -vvv trace).
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    /// The RDMA device: `mrkit0` (the embedded device), a device name (`mlx5_0`), or a name
    /// qualified by its provider (`rdma-core:mlx5_0`). Default: $MRKIT_DEVICE, else mrkit0.
    #[arg(long, global = true, value_name = "NAME")]
    device: Option<String>,
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Allocate a buffer, register it on mrkit0 and print the keys and translation.
    Reg(cmd::reg::RegArgs),
    /// A guided tour: keys, translation, the classic mistakes and their real errors.
    Demo(cmd::demo::DemoArgs),
    /// A perftest-like pair over RoCEv2/UDP: bandwidth, message rate, latency, data verified.
    Perf(cmd::perf::PerfArgs),
    /// Device, port, GID and every attribute and limit in force, with its source (like ibv_devinfo -v).
    Devinfo(cmd::devinfo::DevinfoArgs),
    /// How much memory this process can register now, term by term, with and without THP.
    Capacity(cmd::capacity::CapacityArgs),
    /// Check the environment against the registration checklist; `doctor explain ERRNO` for failures.
    Doctor(cmd::doctor::DoctorArgs),
    /// Live registration counters of running mrkit processes (like `rdma stat show mr`).
    Stat(cmd::stat::StatArgs),
    /// The seeds' experiments as one suite: Markdown report, SVG plots, raw JSON.
    Bench(cmd::bench::BenchArgs),
    /// Print a shell completion script.
    Completions(cmd::completions::CompletionsArgs),
}

/// `mrkit __stat-hold`: test helper outside the public command tree (so completions and help
/// never show it): register memory, export statistics, wait.
#[derive(Parser, Debug)]
#[command(name = "mrkit __stat-hold")]
struct HoldCli {
    #[command(flatten)]
    args: cmd::stat::HoldArgs,
}

fn main() -> ExitCode {
    out::install_panic_hook();
    if std::env::args_os()
        .nth(1)
        .is_some_and(|a| a == "__stat-hold")
    {
        let h = HoldCli::parse_from(std::env::args_os().skip(1));
        return ExitCode::from(cmd::stat::hold(h.args));
    }
    let cli = Cli::parse();
    // `devinfo -v` means "all attributes" (as ibv_devinfo -v): logging starts at -vv there.
    let log_v = match cli.cmd {
        Command::Devinfo(_) => cli.verbose.saturating_sub(1),
        _ => cli.verbose,
    };
    let level = match log_v {
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
    let dev = cmd::device::Selected::new(cli.device);
    let code = match cli.cmd {
        Command::Reg(a) => cmd::reg::run(a, &dev),
        Command::Demo(a) => cmd::demo::run(a, &dev),
        Command::Perf(a) => cmd::perf::run(a, &dev),
        Command::Devinfo(a) => cmd::devinfo::run(a, cli.verbose > 0, &dev),
        Command::Capacity(a) => cmd::capacity::run(a, &dev),
        Command::Doctor(a) => cmd::doctor::run(a, &dev),
        Command::Stat(a) => cmd::stat::run(a, &dev),
        Command::Bench(a) => cmd::bench::run(a, &dev),
        Command::Completions(a) => cmd::completions::run(a),
    };
    out::flush();
    // Opening a device starts the statistics exporter (`mrkit stat`): remove its files.
    mrkit::stat_export::shutdown();
    ExitCode::from(code)
}
