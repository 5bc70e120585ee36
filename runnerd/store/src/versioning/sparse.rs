//! Blob files written with holes where the content has whole blocks of zeros (issue #32).
//!
//! A digest is of the bytes, not of their storage: a sparse workspace file (a 256 MiB
//! `truncate`d file costs 8 KiB of disk) stored densely grew the shared store by its whole
//! length at every run that changed it. Readers — ours and the original's, which read blob
//! files directly — see the same bytes from a hole as from written zeros.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// The unit a hole is left for: a block-aligned run of this many zero bytes is skipped. The
/// page size, which every filesystem's block size here divides or equals.
const BLOCK: u64 = 4096;

/// A file being written front to back, with no write for the aligned zero blocks.
pub(crate) struct SparseWriter {
    file: File,
    pos: u64,
}

impl SparseWriter {
    pub(crate) fn new(file: File) -> SparseWriter {
        SparseWriter { file, pos: 0 }
    }

    /// Appends `buf`: the pieces up to each block boundary that are not whole blocks of
    /// zeros are written, consecutive ones in one `pwrite` (a chunk of data is one call).
    pub(crate) fn write(&mut self, buf: &[u8]) -> io::Result<()> {
        // The run of data not yet written: its file offset and its bytes in `buf`.
        let mut run: Option<(u64, usize, usize)> = None;
        let mut at = 0usize;
        while at < buf.len() {
            let room = (BLOCK - self.pos % BLOCK) as usize;
            let len = room.min(buf.len() - at);
            let hole = len as u64 == BLOCK && is_zero(&buf[at..at + len]);
            match (&mut run, hole) {
                (Some((_, _, end)), false) => *end = at + len,
                (None, false) => run = Some((self.pos, at, at + len)),
                (Some((offset, start, end)), true) => {
                    self.file.write_all_at(&buf[*start..*end], *offset)?;
                    run = None;
                }
                (None, true) => {}
            }
            self.pos += len as u64;
            at += len;
        }
        if let Some((offset, start, end)) = run {
            self.file.write_all_at(&buf[start..end], offset)?;
        }
        Ok(())
    }

    /// Sets the length (a trailing hole was never written) and gives the file back.
    pub(crate) fn finish(self) -> io::Result<File> {
        self.file.set_len(self.pos)?;
        Ok(self.file)
    }
}

fn is_zero(bytes: &[u8]) -> bool {
    // Word at a time: a block of data is usually told from zeros by its first word.
    let words = bytes.chunks_exact(8);
    let tail = words.remainder();
    words.into_iter().all(|w| w == [0u8; 8]) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn written(chunks: &[&[u8]]) -> (Vec<u8>, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        let mut w = SparseWriter::new(File::create(&path).unwrap());
        for c in chunks {
            w.write(c).unwrap();
        }
        let file = w.finish().unwrap();
        file.sync_all().unwrap();
        let blocks = file.metadata().unwrap().blocks();
        let mut back = Vec::new();
        File::open(&path).unwrap().read_to_end(&mut back).unwrap();
        (back, blocks * 512)
    }

    #[test]
    fn the_bytes_read_back_are_the_bytes_written() {
        let zeros = vec![0u8; 1 << 20];
        let mut data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8 + 1).collect();
        data[5000..9100].fill(0);
        let cases: Vec<Vec<&[u8]>> = vec![
            vec![],
            vec![b"x"],
            vec![&zeros],
            vec![&zeros[..4095]],
            vec![&zeros[..5000], b"tail"],
            vec![b"head", &zeros, b"mid", &zeros[..7000]],
            vec![&data, &zeros[..3], &data[..17]],
        ];
        for chunks in cases {
            let want: Vec<u8> = chunks.concat();
            let (back, _) = written(&chunks);
            assert_eq!(back.len(), want.len());
            assert!(
                back == want,
                "content differs for chunks of {:?}",
                chunks.iter().map(|c| c.len()).collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn whole_zero_blocks_take_no_disk() {
        let zeros = vec![0u8; 64 << 20];
        let (back, allocated) = written(&[b"start", &zeros, b"end"]);
        assert_eq!(back.len(), 64 * 1024 * 1024 + 8);
        // Two data blocks (and some metadata on some filesystems), not 64 MiB.
        assert!(allocated < 1 << 20, "64 MiB of zeros allocated {allocated} bytes");
    }

    #[test]
    fn is_zero_table() {
        for (bytes, want) in [
            (&[][..], true),
            (&[0u8; 7][..], true),
            (&[0u8; 9][..], true),
            (&[0, 0, 0, 0, 0, 0, 0, 0, 1][..], false),
            (&[1, 0, 0, 0, 0, 0, 0, 0][..], false),
        ] {
            assert_eq!(is_zero(bytes), want, "{bytes:?}");
        }
    }
}
