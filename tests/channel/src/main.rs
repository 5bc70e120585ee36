//! `make-test-channel DIR`: the demo channel (see `test_channel::demo`) for manual and
//! benchmark use.

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args_os().nth(1).context("usage: make-test-channel DIR")?;
    let channel = test_channel::demo(std::path::Path::new(&dir))?;
    println!("{}", channel.url());
    Ok(())
}
