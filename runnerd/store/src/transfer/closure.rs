//! The objects a head reaches, in the order a receiver can store them: every record after
//! the objects it names, so a receiver that validates each record as it arrives never meets
//! a dangling reference.

use std::collections::HashSet;

use super::TransferError;
use crate::versioning::{Ref, Store};

/// Every object `root` (a record) reaches: blobs and records, each once, children before the
/// records that name them, `root` last. Records are read verified (Store::read_record: digest,
/// re-canonicalisation, declared dependencies); blobs are only listed, not read. A record for
/// which `known(r)` is true is skipped with everything beneath it (its closure is known to be
/// present where we send). Iterative (no recursion: trees can be deep).
pub fn closure(
    store: &Store,
    root: &Ref,
    known: &mut dyn FnMut(&Ref) -> bool,
) -> Result<Vec<Ref>, TransferError> {
    root.validate()?;
    let mut seen: HashSet<Ref> = HashSet::from([root.clone()]);
    let mut out = Vec::new();
    if !root.is_record() {
        out.push(root.clone());
        return Ok(out);
    }
    if known(root) {
        return Ok(out);
    }
    // Each open record with its dependencies and how many of them were visited.
    let mut stack = vec![(root.clone(), store.read_record(root, None)?.dependencies, 0usize)];
    while let Some((_, deps, next)) = stack.last_mut() {
        let Some(dep) = deps.get(*next).cloned() else {
            let (done, _, _) = stack.pop().expect("a record is open");
            out.push(done);
            continue;
        };
        *next += 1;
        if !seen.insert(dep.clone()) {
            continue;
        }
        dep.validate()?;
        if !dep.is_record() {
            out.push(dep);
        } else if !known(&dep) {
            let deps = store.read_record(&dep, None)?.dependencies;
            stack.push((dep, deps, 0));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::fs;

    use serde_json::json;

    use super::*;
    use crate::versioning::testutil::{example_workspace, temp_store};
    use crate::versioning::{OCTET_STREAM, Pool, RECORD_MEDIA_TYPE, VersionError};

    /// The example workspace's snapshot: root tree, `data` and `empty` trees, three files.
    fn snapshot() -> (tempfile::TempDir, Store, Ref) {
        let (dir, store) = temp_store();
        let ws = dir.path().join("ws");
        fs::create_dir(&ws).unwrap();
        example_workspace(&ws);
        let root = store.snapshot(&ws).unwrap();
        (dir, store, root)
    }

    /// Every record comes after each object it names.
    fn assert_children_first(store: &Store, order: &[Ref]) {
        let at: HashMap<&Ref, usize> = order.iter().enumerate().map(|(i, r)| (r, i)).collect();
        for (i, r) in order.iter().enumerate().filter(|(_, r)| r.is_record()) {
            for dep in store.read_record(r, None).unwrap().dependencies {
                if let Some(&j) = at.get(&dep) {
                    assert!(j < i, "{} listed after the record {} naming it", dep.digest, r.digest);
                }
            }
        }
    }

    #[test]
    fn a_snapshots_closure_lists_each_object_once_children_first_root_last() {
        let (_dir, store, root) = snapshot();
        let mut asked = Vec::new();
        let order = closure(&store, &root, &mut |r| {
            asked.push(r.clone());
            false
        })
        .unwrap();
        assert_eq!(order.len(), store.validate_closure(&root).unwrap());
        assert_eq!(order.len(), 6, "three trees, three file contents");
        assert_eq!(order.iter().filter(|r| r.is_record()).count(), 3);
        assert_eq!(order.iter().collect::<HashSet<_>>().len(), order.len(), "each once");
        assert_eq!(order.last(), Some(&root));
        assert_children_first(&store, &order);
        assert_eq!(asked.len(), 3, "known is asked once per record");

        // Two records naming the same subtree and blob: listed once, before both.
        let shared = store.put_record("T", json!({"a": root.to_value()})).unwrap();
        let top = store.put_record("T", json!({"x": shared.to_value(), "y": root.to_value()})).unwrap();
        let order = closure(&store, &top, &mut |_| false).unwrap();
        assert_eq!(order.len(), 8);
        assert_eq!(order.last(), Some(&top));
        assert_children_first(&store, &order);
    }

    #[test]
    fn known_records_are_skipped_with_everything_beneath_them() {
        let (_dir, store, root) = snapshot();
        let full = closure(&store, &root, &mut |_| false).unwrap();
        let data_tree = full
            .iter()
            .find(|r| {
                r.is_record() && *r != &root && !store.read_record(r, None).unwrap().dependencies.is_empty()
            })
            .unwrap()
            .clone();
        let order = closure(&store, &root, &mut |r| *r == data_tree).unwrap();
        assert!(!order.contains(&data_tree));
        // data/x.csv's content is only beneath the known tree.
        let below = store.read_record(&data_tree, None).unwrap().dependencies;
        assert!(below.iter().all(|r| !order.contains(r)));
        assert_eq!(order.len(), full.len() - 1 - below.len());
        assert_eq!(order.last(), Some(&root));
        assert!(closure(&store, &root, &mut |_| true).unwrap().is_empty(), "a known root sends nothing");
    }

    #[test]
    fn a_missing_blob_is_listed_but_a_missing_or_bad_record_fails() {
        let (_dir, store) = temp_store();
        let absent = Ref::new(Pool::Data, &"ab".repeat(32), 3, OCTET_STREAM);
        let root = store.put_record("T", json!({"x": absent.to_value()})).unwrap();
        assert_eq!(closure(&store, &root, &mut |_| false).unwrap(), vec![absent, root.clone()]);

        let gone = Ref::new(Pool::AgentState, &"cd".repeat(32), 10, RECORD_MEDIA_TYPE);
        let top = store.put_record("T", json!({"x": gone.to_value()})).unwrap();
        let e = closure(&store, &top, &mut |_| false).unwrap_err();
        assert!(matches!(e, TransferError::Version(VersionError::Missing { .. })), "{e}");

        // Valid JSON whose bytes are not its canonical form (a space) is refused.
        let text = br#"{"dependencies":[], "kind":"T","schemaVersion":1,"value":1}"#;
        let loose = store.put(Pool::AgentState, text, RECORD_MEDIA_TYPE).unwrap();
        let wrapper = store.put_record("T", json!({"x": loose.to_value()})).unwrap();
        let e = closure(&store, &wrapper, &mut |_| false).unwrap_err();
        assert!(matches!(e, TransferError::Version(VersionError::Schema)), "{e}");
    }
}
