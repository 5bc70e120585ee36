//! `make-test-channel DIR`: the demo channel (see `test_channel::demo`) for manual and
//! benchmark use, plus a real `r-base` copied from the host's R when it has one.

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args_os().nth(1).context("usage: make-test-channel DIR")?;
    let mut channel = test_channel::demo(std::path::Path::new(&dir))?;
    if let Some(home) = test_channel::host_r_home() {
        channel.r_from_host(&home)?;
        channel.index()?;
    }
    println!("{}", channel.url());
    Ok(())
}
