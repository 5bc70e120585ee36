//! What a file costs against a workspace's quota: one measure for the walk that checks the
//! quota (the engine's `measure`), the change journal and the remote workspace's uploads.

/// What one regular file costs against the quota: its apparent size, as the original sums
/// `stat.size` (and what a snapshot stores), plus whatever is allocated beyond that size
/// rounded up to whole blocks of `block_size` (`st_blksize`): preallocation past the end
/// (`fallocate` with `KEEP_SIZE`), which the size does not show. The last, partly used block
/// of an ordinary file is not charged.
pub fn charged(size: u64, blocks: u64, block_size: u64) -> u64 {
    let unit = block_size.max(512);
    let used_blocks = size.div_ceil(unit).saturating_mul(unit);
    size.saturating_add(blocks.saturating_mul(512).saturating_sub(used_blocks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charges_are_the_size_plus_blocks_beyond_it() {
        for (size, blocks, block_size, want) in [
            (0, 0, 4096, 0),
            (5, 8, 4096, 5),
            (500, 8, 4096, 500),
            (5000, 16, 4096, 5000),
            (4096, 16, 4096, 8192),
            (1 << 28, 16, 4096, 1 << 28),
            (0, 2048, 4096, 1 << 20),
            (100, 2048, 4096, 100 + (1 << 20) - 4096),
            (700, 2, 0, 700),
            (u64::MAX, u64::MAX, 4096, u64::MAX),
        ] {
            assert_eq!(charged(size, blocks, block_size), want, "{size} {blocks} {block_size}");
        }
    }
}
