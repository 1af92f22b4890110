//! Child processes of the suite: this executable started as a helper in its own process
//! group, and stopped with everything it started.

/// `mrkit <args>` (this executable) as a helper child: in its own process group, so that
/// [`kill_group`] also stops what it starts (a perf server); short-lived, so no statistics
/// files left behind; stdin closed.
pub(super) fn helper_command(args: &[&str]) -> Result<std::process::Command, String> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = std::process::Command::new(exe);
    c.args(args)
        .process_group(0)
        .env("MRKIT_STAT", "0")
        .stdin(std::process::Stdio::null());
    Ok(c)
}

/// Kill the process group of a [`helper_command`] child and the child itself, and reap it.
pub(super) fn kill_group(child: &mut std::process::Child) {
    if let Some(pg) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process_group(pg, rustix::process::Signal::KILL);
    }
    let _ = child.kill();
    let _ = child.wait();
}
