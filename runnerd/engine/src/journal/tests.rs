use super::*;
use crate::measure as files;
use crate::versioning::snapshot::SnapshotScope;
use std::fs;
use std::os::unix::fs::PermissionsExt;

#[test]
fn what_each_event_means() {
    use AddWatchFlags as F;
    let table = [
        (F::IN_Q_OVERFLOW, false, Meaning::Overflow),
        (F::IN_IGNORED, false, Meaning::Ignored),
        (F::IN_DELETE_SELF, false, Meaning::SelfGone),
        (F::IN_MOVE_SELF, false, Meaning::SelfGone),
        (F::IN_ATTRIB, false, Meaning::SelfChanged),
        (F::IN_OPEN, false, Meaning::Nothing),
        (F::IN_CREATE | F::IN_ISDIR, true, Meaning::DirAppeared),
        (F::IN_MOVED_TO | F::IN_ISDIR, true, Meaning::DirAppeared),
        (F::IN_DELETE | F::IN_ISDIR, true, Meaning::DirLeft),
        (F::IN_MOVED_FROM | F::IN_ISDIR, true, Meaning::DirLeft),
        (F::IN_ATTRIB | F::IN_ISDIR, true, Meaning::DirChanged),
        (F::IN_CREATE, true, Meaning::Arrived { replacing: false }),
        (F::IN_MOVED_TO, true, Meaning::Arrived { replacing: true }),
        (F::IN_DELETE, true, Meaning::Gone),
        (F::IN_MOVED_FROM, true, Meaning::Gone),
        (F::IN_MODIFY, true, Meaning::Written),
        (F::IN_CLOSE_WRITE, true, Meaning::Written),
        (F::IN_ATTRIB, true, Meaning::Written),
        (F::IN_OPEN, true, Meaning::Nothing),
    ];
    for (mask, named, want) in table {
        assert_eq!(meaning(mask, named), want, "{mask:?}");
    }
}

/// A small deterministic generator (no dependency for a test's dice).
struct Dice(u64);

impl Dice {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

fn pinned(p: &Path) -> OwnedFd {
    crate::fsat::open_path(p, libc::O_PATH | libc::O_DIRECTORY).unwrap()
}

/// Writes through a shared mapping: no event at all until the file is closed.
fn mmap_write(path: &Path) {
    use std::os::fd::AsRawFd;
    let f = fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len().max(1) as usize;
    f.set_len(len as u64).unwrap();
    // SAFETY: a fresh shared mapping of a file we hold open, within its length, unmapped below.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        assert_ne!(p, libc::MAP_FAILED);
        *(p as *mut u8) = b'M';
        libc::msync(p, len, libc::MS_SYNC);
        libc::munmap(p, len);
    }
}

/// One random change somewhere in `root`.
fn mutate(root: &Path, dice: &mut Dice) {
    let dirs = ["", "a", "a/b", "c", "c/d/e", "moved"];
    let dir = root.join(dirs[dice.next(dirs.len() as u64) as usize]);
    let _ = fs::create_dir_all(&dir);
    let name = format!("f{}", dice.next(6));
    let path = dir.join(&name);
    let other = root.join(dirs[dice.next(dirs.len() as u64) as usize]).join(format!("f{}", dice.next(6)));
    let _ = match dice.next(12) {
        0 => fs::write(&path, vec![b'x'; dice.next(5000) as usize]),
        1 => fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"more")),
        2 => fs::OpenOptions::new().write(true).open(&path).and_then(|f| f.set_len(dice.next(10))),
        3 => fs::rename(&path, &other),
        4 => fs::remove_dir_all(root.join(["a/b", "c", "moved"][dice.next(3) as usize])),
        // Never through a symlink (that would chmod the directory it names).
        5 if path.symlink_metadata().is_ok_and(|m| m.is_file()) => {
            fs::set_permissions(&path, fs::Permissions::from_mode([0o600, 0o755][dice.next(2) as usize]))
        }
        6 => fs::hard_link(&path, &other),
        7 => std::os::unix::fs::symlink(&dir, &other),
        8 if path.is_file() => {
            mmap_write(&path);
            Ok(())
        }
        9 => fs::rename(
            root.join(["a", "c/d", "moved"][dice.next(3) as usize]),
            root.join(["moved", "c/d2"][dice.next(2) as usize]),
        ),
        10 => fs::remove_file(&path),
        _ => fs::write(&other, format!("{}", dice.next(1_000_000))),
    };
}

fn store() -> (tempfile::TempDir, crate::versioning::Store) {
    let data = tempfile::tempdir().unwrap();
    let store = crate::versioning::Store::open(data.path()).unwrap();
    (data, store)
}

/// The differential test: random workloads, each run's journal against full walks (bytes,
/// createdFiles, modifiedFiles) and its reusing snapshot against a full one, with writes
/// between runs too.
#[test]
fn the_journal_says_what_a_full_walk_says() {
    let journal = Journal::new(JournalSettings::default());
    assert!(journal.enabled(), "inotify is available here");
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("a/b")).unwrap();
    for i in 0..50 {
        fs::write(root.join(format!("a/b/seed{i}")), "s").unwrap();
    }
    let (_data, store) = store();
    let mut dice = Dice(31);
    let mut journaled = 0;
    for round in 0..60 {
        let fd = pinned(&root);
        let walked_before = files::measure(fd.as_fd());
        let (m, watch) = journal.begin(&root, &fd);
        assert_eq!(m.bytes, walked_before.bytes, "round {round}: before");
        let watch = watch.expect("journaled");
        for _ in 0..dice.next(8) {
            mutate(&root, &mut dice);
        }
        let walked = files::measure(fd.as_fd());
        match watch.finish() {
            Ok((after, changes)) => {
                journaled += 1;
                assert_eq!(after.bytes, walked.bytes, "round {round}: after");
                assert_eq!(changes, files::changes(&walked_before.prints, &walked.prints), "round {round}");
            }
            Err(before) => assert_eq!(before, walked_before.prints, "round {round}: fallback"),
        }
        let reuse = watch.reuse();
        let dir = crate::fsat::pinned_dir(&fd);
        let scope = SnapshotScope { reuse: Some(reuse.clone()), ..SnapshotScope::default() };
        let reused = store.snapshot_scoped(&dir, &scope).unwrap();
        watch.snapshot_done(&reuse);
        assert_eq!(reused, store.snapshot(&dir).unwrap(), "round {round}: snapshot");
        drop(watch);
        // Outside any run.
        if dice.next(3) == 0 {
            mutate(&root, &mut dice);
        }
    }
    assert!(journaled > 50, "{journaled}");
}

/// A write through one name of a linked file changes the other name's directory too, which
/// no event names: the snapshot must not reuse it.
#[test]
fn a_snapshot_reads_the_other_names_of_a_linked_file_again() {
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("far/away")).unwrap();
    fs::write(root.join("f"), "one").unwrap();
    fs::hard_link(root.join("f"), root.join("far/away/g")).unwrap();
    let (_data, store) = store();
    let fd = pinned(&root);
    let dir = crate::fsat::pinned_dir(&fd);
    for round in 0..3 {
        let (_, watch) = journal.begin(&root, &fd);
        let watch = watch.unwrap();
        fs::write(root.join("f"), format!("round {round}")).unwrap();
        let (_, (_, modified)) = watch.finish().unwrap();
        assert_eq!(modified, vec!["f".to_string(), "far/away/g".to_string()]);
        let reuse = watch.reuse();
        let scope = SnapshotScope { reuse: Some(reuse.clone()), ..SnapshotScope::default() };
        let reused = store.snapshot_scoped(&dir, &scope).unwrap();
        watch.snapshot_done(&reuse);
        assert_eq!(reused, store.snapshot(&dir).unwrap(), "round {round}");
    }
}

#[test]
fn a_lost_event_falls_back_to_one_walk() {
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(&root).unwrap();
    let fd = pinned(&root);
    let (_, watch) = journal.begin(&root, &fd);
    let watch = watch.unwrap();
    fs::write(root.join("x"), "12345").unwrap();
    watch.0.inner.drain();
    lock(&watch.0.watched.pending).lose("a test".into());
    let before = watch.finish().unwrap_err();
    assert!(before.is_empty(), "the fingerprints before the run");
    drop(watch);
    let lost = journal.counts().3[Fallback::ALL.iter().position(|f| *f == Fallback::Lost).unwrap()];
    assert_eq!(lost, 1);
    let (m, watch) = journal.begin(&root, &fd);
    assert_eq!(m.prints.len(), 1, "walked again");
    assert!(watch.is_some(), "and journaled again");
}

/// The root's own mode is named by no watched parent: a change to it (a sandbox's
/// `chmod 000 /workspace`, which an unprivileged runnerd could then not read) is a lost
/// event, and the walk that follows fails closed as it always has.
#[test]
fn the_roots_own_mode_changing_is_a_lost_event() {
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(&root).unwrap();
    let fd = pinned(&root);
    let (_, watch) = journal.begin(&root, &fd);
    let watch = watch.unwrap();
    fs::set_permissions(&root, fs::Permissions::from_mode(0o300)).unwrap();
    assert!(watch.finish().is_err());
    fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).unwrap();
}

#[test]
fn the_queue_overflowing_is_a_lost_event() {
    // A queue of 16,384 events by default: this many distinct files overflow it while
    // nothing drains (the reader thread is starved of the lock meanwhile).
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(&root).unwrap();
    let fd = pinned(&root);
    let (_, watch) = journal.begin(&root, &fd);
    let watch = watch.unwrap();
    let max = fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
        .unwrap()
        .trim()
        .parse::<usize>()
        .unwrap();
    {
        let _held = lock(&watch.0.inner.watches);
        for i in 0..max + 10 {
            fs::write(root.join(format!("{i}")), "").unwrap();
        }
    }
    assert!(watch.finish().is_err(), "the overflow was noticed");
}

#[test]
fn watches_and_workspaces_stay_bounded() {
    let journal = Journal::new(JournalSettings { workspaces: 4, watches: 50, ..JournalSettings::default() });
    let ws = tempfile::tempdir().unwrap();
    for i in 0..40 {
        let root = ws.path().join(format!("w{i}"));
        fs::create_dir_all(root.join("a/b")).unwrap();
        let fd = pinned(&root);
        let (_, watch) = journal.begin(&root, &fd);
        assert!(watch.is_some());
    }
    let (spaces, watches, _, _) = journal.counts();
    assert_eq!((spaces, watches), (4, 12));
    // A workspace with more directories than watches left is walked instead.
    let big = ws.path().join("big");
    for i in 0..60 {
        fs::create_dir_all(big.join(format!("d{i}"))).unwrap();
    }
    let fd = pinned(&big);
    let (m, watch) = journal.begin(&big, &fd);
    assert!(watch.is_none() && m.unreadable.is_none());
    assert!(journal.counts().1 <= 50);
}

/// Memory stays bounded: a workspace over its share of files is walked instead, and a flood
/// of changes between runs turns into one walk rather than a growing list.
#[test]
fn files_and_pending_changes_stay_bounded() {
    let journal = Journal::new(JournalSettings { workspaces: 2, files: 40, ..JournalSettings::default() });
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(&root).unwrap();
    for i in 0..30 {
        fs::write(root.join(format!("{i}")), "x").unwrap();
    }
    let fd = pinned(&root);
    let (m, watch) = journal.begin(&root, &fd);
    assert!(watch.is_none() && m.prints.len() == 30, "30 files over a share of 20: walked");
    // Directories count against the share too (a tenant's million empty directories).
    let dirs = ws.path().join("dirs");
    for i in 0..30 {
        fs::create_dir_all(dirs.join(format!("{i}"))).unwrap();
    }
    let dfd = pinned(&dirs);
    let (m, watch) = journal.begin(&dirs, &dfd);
    assert!(watch.is_none() && m.unreadable.is_none(), "30 directories over a share of 20: walked");

    let journal = Journal::new(JournalSettings { workspaces: 1, files: 2000, ..JournalSettings::default() });
    let (_, watch) = journal.begin(&root, &fd);
    watch.unwrap().finish().unwrap();
    for i in 0..5000 {
        fs::write(root.join(format!("{}", i % 1000)), format!("{i}")).unwrap();
        if i % 500 == 0 {
            journal.inner.as_ref().unwrap().drain();
        }
    }
    journal.inner.as_ref().unwrap().drain();
    let w = lock(&journal.inner.as_ref().unwrap().spaces).values().next().cloned().unwrap();
    let pending = lock(&w.pending);
    assert!(pending.paths.len() <= 1000, "one entry per path: {}", pending.paths.len());
    drop(pending);
    // Distinct paths past the bound.
    for i in 0..2010 {
        fs::write(root.join(format!("n{i}")), "").unwrap();
        if i % 500 == 0 {
            journal.inner.as_ref().unwrap().drain();
        }
    }
    journal.inner.as_ref().unwrap().drain();
    let pending = lock(&w.pending);
    assert!(pending.lost.is_some() && pending.paths.is_empty(), "{}", pending.paths.len());
}

// The red-team review's cases (each failed before its fix).

fn snap_pair(
    store: &crate::versioning::Store,
    watch: &RunWatch,
    fd: &OwnedFd,
) -> (crate::versioning::Ref, crate::versioning::Ref) {
    let reuse = watch.reuse();
    let dir = crate::fsat::pinned_dir(fd);
    let scope = SnapshotScope { reuse: Some(reuse.clone()), ..SnapshotScope::default() };
    let reused = store.snapshot_scoped(&dir, &scope).unwrap();
    watch.snapshot_done(&reuse);
    (reused, store.snapshot(&dir).unwrap())
}

/// `watch`'s end says what a walk says now (bytes, createdFiles/modifiedFiles against the
/// fingerprints `before`), and its reusing snapshot is the full one.
fn like_a_walk(
    label: &str,
    watch: &RunWatch,
    fd: &OwnedFd,
    store: &crate::versioning::Store,
    before: &Fingerprints,
) {
    let walked = files::measure(fd.as_fd());
    let (after, changes) = watch.finish().unwrap_or_else(|_| panic!("{label}: the journal gave up"));
    assert_eq!(after.bytes, walked.bytes, "{label}");
    assert_eq!(changes, files::changes(before, &walked.prints), "{label}");
    let (reused, full) = snap_pair(store, watch, fd);
    assert_eq!(reused, full, "{label}");
}

/// A workspace journaled and snapshotted once, for a case to start from.
fn journaled(root: &Path) -> (Journal, OwnedFd, tempfile::TempDir, crate::versioning::Store) {
    let journal = Journal::new(JournalSettings::default());
    let (data, store) = store();
    let fd = pinned(root);
    let (_, w0) = journal.begin(root, &fd);
    let w0 = w0.unwrap();
    w0.finish().unwrap();
    let (a, b) = snap_pair(&store, &w0, &fd);
    assert_eq!(a, b);
    (journal, fd, data, store)
}

/// Link Y/g as X/f, open X/f for writing, unlink it, write: every write is named "X/f",
/// which is gone; Y/g changed. With an update between each step (the quota watchdog's)
/// and without.
#[test]
fn a_write_through_a_removed_name_reaches_the_files_other_names() {
    use std::io::Write;
    for watchdog in [false, true] {
        let ws = tempfile::tempdir().unwrap();
        let root = ws.path().join("w");
        fs::create_dir_all(root.join("X")).unwrap();
        fs::create_dir_all(root.join("Y")).unwrap();
        fs::write(root.join("Y/g"), "old").unwrap();
        let (journal, fd, _data, store) = journaled(&root);
        let before = files::measure(fd.as_fd()).prints;
        let (_, w1) = journal.begin(&root, &fd);
        let w1 = w1.unwrap();
        let tick = || {
            if watchdog {
                let _ = w1.measure();
            }
        };
        fs::hard_link(root.join("Y/g"), root.join("X/f")).unwrap();
        tick();
        let mut h = fs::OpenOptions::new().write(true).open(root.join("X/f")).unwrap();
        fs::remove_file(root.join("X/f")).unwrap();
        tick();
        h.write_all(&vec![b'z'; 1 << 20]).unwrap();
        tick();
        h.write_all(b"more").unwrap();
        drop(h);
        let walked = files::measure(fd.as_fd());
        match w1.finish() {
            Ok((after, changes)) => {
                assert_eq!(after.bytes, walked.bytes, "watchdog {watchdog}");
                assert_eq!(changes, files::changes(&before, &walked.prints), "watchdog {watchdog}");
            }
            Err(b) => assert_eq!(b, before, "a fallback, with the fingerprints from before"),
        }
        let (reused, full) = snap_pair(&store, &w1, &fd);
        assert_eq!(reused, full, "watchdog {watchdog}");
    }
}

/// Replacing a name by rename while a descriptor still writes the inode it held.
#[test]
fn a_write_through_a_replaced_name_reaches_the_files_other_names() {
    use std::io::Write;
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("A")).unwrap();
    fs::create_dir_all(root.join("B")).unwrap();
    fs::write(root.join("A/n"), "old").unwrap();
    let (journal, fd, _data, store) = journaled(&root);
    let before = files::measure(fd.as_fd()).prints;
    let (_, w1) = journal.begin(&root, &fd);
    let w1 = w1.unwrap();
    fs::hard_link(root.join("A/n"), root.join("B/q")).unwrap();
    let _ = w1.measure();
    let mut h = fs::OpenOptions::new().append(true).open(root.join("A/n")).unwrap();
    fs::write(root.join("A/tmp"), "new").unwrap();
    fs::rename(root.join("A/tmp"), root.join("A/n")).unwrap();
    let _ = w1.measure();
    h.write_all(&vec![b'z'; 100_000]).unwrap();
    drop(h);
    like_a_walk("", &w1, &fd, &store, &before);
}

/// A run that never reaches finish() (timed out, cancelled, stopped by the quota) still
/// commits: its snapshot must read the other names of what it wrote.
#[test]
fn an_unfinished_runs_snapshot_reads_the_other_names() {
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("A")).unwrap();
    fs::create_dir_all(root.join("B")).unwrap();
    fs::write(root.join("A/f"), "one").unwrap();
    fs::hard_link(root.join("A/f"), root.join("B/g")).unwrap();
    let (journal, fd, _data, store) = journaled(&root);
    let (_, w1) = journal.begin(&root, &fd);
    let w1 = w1.unwrap();
    fs::write(root.join("A/f"), "written, then the run timed out").unwrap();
    let (reused, full) = snap_pair(&store, &w1, &fd);
    assert_eq!(reused, full);
}

/// The reader walks nothing: a directory renamed back and forth in one workspace does not
/// hold up another's measurement.
#[test]
fn renames_in_one_workspace_do_not_stall_another() {
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let (a, b, big) = (ws.path().join("a"), ws.path().join("b"), ws.path().join("big"));
    for d in [&a, &b, &big] {
        fs::create_dir_all(d).unwrap();
    }
    for i in 0..5_000 {
        fs::create_dir(big.join(format!("{i}"))).unwrap();
    }
    let fa = pinned(&a);
    let (_, wa) = journal.begin(&a, &fa);
    let _wa = wa.unwrap();
    fs::rename(&big, a.join("X")).unwrap();
    for _ in 0..100 {
        fs::rename(a.join("X"), a.join("Y")).unwrap();
        fs::rename(a.join("Y"), a.join("X")).unwrap();
    }
    let fb = pinned(&b);
    let t = std::time::Instant::now();
    let (_, wb) = journal.begin(&b, &fb);
    assert!(wb.is_some());
    // Not a timing test: the reader's cost per event is now a lookup, so this is far
    // below what walking 5,000 directories 200 times took (seconds).
    eprintln!("another workspace's begin took {:?}", t.elapsed());
    let (ours, _) = (journal.counts().1, ());
    assert!(ours <= 2, "the renamed tree was not watched by the reader: {ours} watches");
}

/// The walk's bounds hold: too deep fails closed (the journal gives up and the walk
/// reports it), as does changed-path text past a walk's bound.
#[test]
fn the_walks_bounds_are_kept() {
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(&root).unwrap();
    let journal = Journal::new(JournalSettings::default());
    let fd = pinned(&root);
    let before = files::measure(fd.as_fd()).prints;
    let (_, w) = journal.begin(&root, &fd);
    let w = w.unwrap();
    let mut p = root.clone();
    for i in 0..files::MAX_WALK_DEPTH + 6 {
        p.push("d");
        fs::create_dir(&p).unwrap();
        if i % 64 == 0 {
            let _ = w.measure();
        }
    }
    fs::write(p.join("f"), vec![b'x'; 4096]).unwrap();
    let walked = files::measure(fd.as_fd());
    assert!(walked.unreadable.is_some(), "the walk fails closed");
    match w.finish() {
        Ok((after, _)) => panic!("the journal counted {} bytes past the depth bound", after.bytes),
        Err(b) => assert_eq!(b, before),
    }
}

#[test]
fn changed_path_text_is_bounded() {
    let mut p = Pending { max: usize::MAX, ..Pending::default() };
    let long = "n".repeat(4096);
    for i in 0..(MAX_PENDING_BYTES / 4096) + 10 {
        p.event(Meaning::Arrived { replacing: false }, format!("{long}/{i}"));
    }
    assert!(p.lost.is_some() && p.paths.is_empty() && p.since_snapshot.is_empty() && p.bytes == 0);
}

/// An enclosing workspace's sandbox links a nested workspace's file into its own directory
/// and writes it there: the nested workspace's journal hears of it.
#[test]
fn a_nested_workspace_hears_of_writes_through_its_parents_links() {
    let journal = Journal::new(JournalSettings::default());
    let ws = tempfile::tempdir().unwrap();
    let outer = ws.path().join("outer");
    let inner = outer.join("agents/c");
    fs::create_dir_all(&inner).unwrap();
    fs::create_dir_all(outer.join("mine")).unwrap();
    fs::write(inner.join("f"), "inner's").unwrap();
    let (fo, fi) = (pinned(&outer), pinned(&inner));
    let (_, wi) = journal.begin(&inner, &fi);
    wi.unwrap().finish().unwrap();
    let before = files::measure(fi.as_fd()).prints;
    let (_, wo) = journal.begin(&outer, &fo);
    let wo = wo.unwrap();
    fs::hard_link(inner.join("f"), outer.join("mine/alias")).unwrap();
    fs::write(outer.join("mine/alias"), "written by the parent's sandbox, longer").unwrap();
    wo.finish().unwrap();
    drop(wo);
    let (m, wi) = journal.begin(&inner, &fi);
    let walked = files::measure(fi.as_fd());
    assert_eq!(m.bytes, walked.bytes);
    let (_, (_, modified)) = wi.unwrap().finish().unwrap();
    assert!(modified.is_empty());
    assert_ne!(before, walked.prints, "the file did change");
}

// The second red-team review's cases that a host can still make (sandboxes cannot make hard
// links: link/linkat answer EXDEV, tests/suite/change_journal.rs).

/// X/f and Y/g are one file (linked before the run): open X/f, remove it and its
/// directory (or rename the directory), then write — no event follows the write.
#[test]
fn a_write_after_the_names_directory_went_reaches_the_other_name() {
    use std::io::Write;
    for rename in [false, true] {
        let ws = tempfile::tempdir().unwrap();
        let root = ws.path().join("w");
        fs::create_dir_all(root.join("X")).unwrap();
        fs::create_dir_all(root.join("Y")).unwrap();
        fs::write(root.join("Y/g"), "old").unwrap();
        fs::hard_link(root.join("Y/g"), root.join("X/f")).unwrap();
        let (journal, fd, _data, store) = journaled(&root);
        let before = files::measure(fd.as_fd()).prints;
        let (_, w1) = journal.begin(&root, &fd);
        let w1 = w1.unwrap();
        let mut h = fs::OpenOptions::new().append(true).open(root.join("X/f")).unwrap();
        fs::remove_file(root.join("X/f")).unwrap();
        if rename {
            fs::rename(root.join("X"), root.join("X2")).unwrap();
        } else {
            fs::remove_dir(root.join("X")).unwrap();
        }
        let _ = w1.measure();
        h.write_all(&vec![b'z'; 1 << 20]).unwrap();
        drop(h);
        like_a_walk(&format!("rename {rename}"), &w1, &fd, &store, &before);
    }
}

/// A host process keeps a descriptor across runs: the inode's other names are read again
/// by the next run.
#[test]
fn a_hosts_write_through_a_removed_name_between_runs_is_read_by_the_next() {
    use std::io::Write;
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("X")).unwrap();
    fs::create_dir_all(root.join("Y")).unwrap();
    fs::write(root.join("Y/g"), "old").unwrap();
    fs::hard_link(root.join("Y/g"), root.join("X/f")).unwrap();
    let (journal, fd, _data, store) = journaled(&root);
    let mut h = fs::OpenOptions::new().append(true).open(root.join("X/f")).unwrap();
    fs::remove_file(root.join("X/f")).unwrap();
    let (_, w1) = journal.begin(&root, &fd);
    let w1 = w1.unwrap();
    w1.finish().unwrap();
    let (a, b) = snap_pair(&store, &w1, &fd);
    assert_eq!(a, b);
    drop(w1);
    h.write_all(&vec![b'h'; 1 << 20]).unwrap();
    drop(h);
    let (m, w2) = journal.begin(&root, &fd);
    assert_eq!(m.bytes, files::measure(fd.as_fd()).bytes);
    let w2 = w2.unwrap();
    w2.finish().unwrap();
    let (a, b) = snap_pair(&store, &w2, &fd);
    assert_eq!(a, b);
}

/// An O_TMPFILE a host names with linkat, then writes through its descriptor: the events
/// name "X/#<inode>", never the name it was given.
#[test]
fn a_named_tmpfiles_writes_reach_its_name() {
    use std::ffi::CString;
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd};
    let ws = tempfile::tempdir().unwrap();
    let root = ws.path().join("w");
    fs::create_dir_all(root.join("X")).unwrap();
    let (journal, fd, _data, store) = journaled(&root);
    let before = files::measure(fd.as_fd()).prints;
    let (_, w1) = journal.begin(&root, &fd);
    let w1 = w1.unwrap();
    let dir = CString::new(root.join("X").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; the descriptor returned is owned below.
    let raw = unsafe { libc::open(dir.as_ptr(), libc::O_TMPFILE | libc::O_WRONLY, 0o644) };
    assert!(raw >= 0, "O_TMPFILE: {}", std::io::Error::last_os_error());
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let mut tmp = unsafe { fs::File::from_raw_fd(raw) };
    tmp.write_all(b"first").unwrap();
    let to = CString::new(root.join("X/name").into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: linkat with AT_EMPTY_PATH on our own descriptor and a NUL-terminated target.
    let linked = unsafe {
        libc::linkat(tmp.as_raw_fd(), c"".as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_EMPTY_PATH)
    };
    assert_eq!(linked, 0, "linkat: {}", std::io::Error::last_os_error());
    let _ = w1.measure();
    tmp.write_all(&vec![b'z'; 1 << 20]).unwrap();
    drop(tmp);
    like_a_walk("", &w1, &fd, &store, &before);
}

/// The changed-path text is uncounted when a snapshot takes it, so a long-lived workspace
/// never reaches the bound by accumulation (the third review's case).
#[test]
fn changed_path_text_is_uncounted_when_a_snapshot_takes_it() {
    let path = "p".repeat(1024);
    let mut p = Pending { max: usize::MAX, ..Pending::default() };
    for round in 0..(MAX_PENDING_BYTES / 1024) * 2 {
        p.changed(format!("{path}/{round}"));
        p.take_paths();
        let upto = p.seq;
        p.forget_snapshot_paths(upto);
        assert!(p.lost.is_none(), "round {round}");
    }
    assert_eq!(p.bytes, 0);
}
