//! What materializing a tree would write, counted before anything is written: a tree from
//! another node is data that names its own size, so the receiver compares it with its quota
//! and its free disk first, and a tree whose subtrees are shared many times over (a root of
//! 1,000 directories all naming one subtree, that subtree 1,000 naming the next, …) is
//! counted in time linear in its distinct records, not in what it unfolds to.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use super::TransferError;
use super::materialize::{Entry, entries_at};
use crate::versioning::{Ref, Store};

/// What a materialize of a tree writes: its entries (files, directories and symlinks, the
/// root itself not included) and its files' bytes (holes included).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub entries: u64,
    pub bytes: u64,
}

impl Totals {
    /// Saturating: a hostile tree can name sizes that overflow a sum.
    fn plus(self, other: Totals) -> Totals {
        Totals {
            entries: self.entries.saturating_add(other.entries),
            bytes: self.bytes.saturating_add(other.bytes),
        }
    }
}

/// One tree record being counted.
struct Level {
    tree: Ref,
    /// Its name in its parent, for errors.
    name: Vec<u8>,
    /// Its subdirectories' trees, and how many are done.
    dirs: Vec<(Vec<u8>, Ref)>,
    next: usize,
    /// Its own entries and bytes, then each finished subdirectory's.
    sum: Totals,
}

/// What materializing `tree` would write ([`Totals`]), each record read verified and its
/// entries checked as materialize checks them. Each distinct tree record is read once (its
/// totals are remembered by ref), so shared subtrees cost nothing more. Refused with
/// [`TransferError::TooLarge`] as soon as the entries counted exceed `max_entries`: a level's
/// entries are counted when it is opened, so what the walk holds in memory is bounded by
/// `max_entries` too. The caller compares the bytes with its quota and its free disk.
/// Iterative: no recursion, however deep.
pub fn tree_totals(store: &Store, tree: &Ref, max_entries: u64) -> Result<Totals, TransferError> {
    let mut known: HashMap<Ref, Totals> = HashMap::new();
    // Everything counted so far: never more than the answer, so past the bound is refused.
    let mut counted = Totals::default();
    let mut stack = vec![open(store, tree.clone(), Vec::new(), &[], &mut counted, max_entries)?];
    loop {
        let level = stack.last_mut().expect("a level is open until the root is done");
        let Some((name, sub)) = level.dirs.get(level.next).cloned() else {
            let done = stack.pop().expect("checked above");
            known.insert(done.tree, done.sum);
            match stack.last_mut() {
                Some(parent) => parent.sum = parent.sum.plus(done.sum),
                None => return Ok(done.sum),
            }
            continue;
        };
        level.next += 1;
        if let Some(&seen) = known.get(&sub) {
            level.sum = level.sum.plus(seen);
            counted = counted.plus(seen);
            over(counted, max_entries)?;
            continue;
        }
        let opened = open(store, sub, name, &stack, &mut counted, max_entries)?;
        stack.push(opened);
    }
}

/// Reads the tree record `tree` (named `name` below the levels on `stack`) and counts its
/// own entries and file bytes into `counted`.
fn open(
    store: &Store,
    tree: Ref,
    name: Vec<u8>,
    stack: &[Level],
    counted: &mut Totals,
    max_entries: u64,
) -> Result<Level, TransferError> {
    let path = || {
        let mut path: PathBuf = stack.iter().skip(1).map(|l| OsStr::from_bytes(&l.name)).collect();
        if !name.is_empty() {
            path.push(OsStr::from_bytes(&name));
        }
        path
    };
    let entries = entries_at(store, &tree, path)?;
    let mut own = Totals { entries: entries.len() as u64, bytes: 0 };
    let mut dirs = Vec::new();
    for entry in entries {
        match entry {
            Entry::File { content, .. } => own.bytes = own.bytes.saturating_add(content.size),
            Entry::Dir { name, tree } => dirs.push((name.into_bytes(), tree)),
            Entry::Symlink { .. } => {}
        }
    }
    *counted = counted.plus(own);
    over(*counted, max_entries)?;
    Ok(Level { tree, name, dirs, next: 0, sum: own })
}

/// [`TransferError::TooLarge`] once `counted` holds more than `max_entries` entries.
fn over(counted: Totals, max_entries: u64) -> Result<(), TransferError> {
    if counted.entries > max_entries {
        return Err(TransferError::TooLarge { entries: counted.entries, bytes: counted.bytes });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::os::fd::AsFd;

    use serde_json::{Value, json};

    use super::*;
    use crate::transfer::materialize::materialize;
    use crate::versioning::names::b64url_encode;
    use crate::versioning::testutil::{example_workspace, temp_store};
    use crate::versioning::{OCTET_STREAM, Pool};

    fn tree_of(store: &Store, entries: Value) -> Ref {
        store.put_record("WorkspaceTree", json!({ "entries": entries })).unwrap()
    }

    fn dir_entry(name: &str, tree: &Ref) -> Value {
        json!({"name": b64url_encode(name.as_bytes()), "tree": tree.to_value(), "type": "directory"})
    }

    /// What the budget says is what a materialize writes.
    #[test]
    fn the_totals_are_what_a_materialize_writes() {
        let (data, store) = temp_store();
        let ws = data.path().join("ws");
        fs::create_dir(&ws).unwrap();
        example_workspace(&ws);
        fs::create_dir_all(ws.join("a/b")).unwrap();
        fs::write(ws.join("a/b/f"), b"12345").unwrap();
        std::os::unix::fs::symlink("f", ws.join("a/b/l")).unwrap();
        let tree = store.snapshot(&ws).unwrap();
        let totals = tree_totals(&store, &tree, u64::MAX).unwrap();
        let out = data.path().join("out");
        fs::create_dir(&out).unwrap();
        let done = materialize(&store, &tree, fs::File::open(&out).unwrap().as_fd(), None).unwrap();
        assert_eq!(totals, Totals { entries: done.files + done.dirs + done.symlinks, bytes: done.bytes });
        assert_eq!(tree_totals(&store, &tree, totals.entries).unwrap(), totals, "the bound is inclusive");
        let e = tree_totals(&store, &tree, totals.entries - 1).unwrap_err();
        assert!(matches!(e, TransferError::TooLarge { .. }), "{e}");
    }

    /// Ten levels of 1,000 directories each naming the next level's one tree unfold to
    /// 1,000^10 entries: counted from 11 records, saturating, and refused at the bound long
    /// before anything like that many entries is visited.
    #[test]
    fn shared_subtrees_are_counted_once_and_saturate() {
        let (_data, store) = temp_store();
        let leaf = store.put(Pool::Data, b"x", OCTET_STREAM).unwrap();
        let mut tree = tree_of(
            &store,
            json!([{"content": leaf.to_value(), "executable": 0, "name": b64url_encode(b"f"), "type": "file"}]),
        );
        let mut want = Totals { entries: 1, bytes: 1 };
        for _ in 0..10 {
            let entries: Vec<Value> = (0..1000).map(|i| dir_entry(&format!("d{i}"), &tree)).collect();
            tree = tree_of(&store, Value::Array(entries));
            want = Totals {
                entries: want.entries.saturating_mul(1000).saturating_add(1000),
                bytes: want.bytes.saturating_mul(1000),
            };
        }
        let started = std::time::Instant::now();
        let totals = tree_totals(&store, &tree, u64::MAX).unwrap();
        assert_eq!(totals, want);
        assert_eq!(totals.entries, u64::MAX, "saturated, not wrapped");
        let e = tree_totals(&store, &tree, 1_000_000).unwrap_err();
        assert!(
            matches!(e, TransferError::TooLarge { entries, .. } if entries > 1_000_000 && entries < 1_010_000),
            "refused as soon as the bound is passed: {e}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(30), "linear in the records");
    }

    /// A chain deeper than a small thread stack would allow a recursive count.
    #[test]
    fn a_deep_chain_is_counted_without_recursion() {
        let (_data, store) = temp_store();
        let mut tree = tree_of(&store, json!([]));
        for _ in 0..2_000 {
            tree = tree_of(&store, json!([dir_entry("d", &tree)]));
        }
        let totals = std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || tree_totals(&store, &tree, u64::MAX).map_err(|e| e.to_string()))
            .unwrap()
            .join()
            .unwrap();
        assert_eq!(totals, Ok(Totals { entries: 2_000, bytes: 0 }));
    }

    /// A bad tree is refused as materialize refuses it, saying where.
    #[test]
    fn a_bad_tree_is_refused_where_it_is_bad() {
        let (_data, store) = temp_store();
        let bad = tree_of(&store, json!([{"name": b64url_encode(b".."), "target": "eA", "type": "symlink"}]));
        let tree = tree_of(&store, json!([dir_entry("a", &tree_of(&store, json!([dir_entry("b", &bad)])))]));
        let e = tree_totals(&store, &tree, u64::MAX).unwrap_err();
        assert!(matches!(&e, TransferError::BadName { name } if name == "a/b/.."), "{e}");
    }
}
