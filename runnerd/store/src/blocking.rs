//! Blocking work awaited by the task that needs its result, run without a thread hop.
//!
//! A `spawn_blocking` hop costs two cross-thread wake-ups (the pool thread's, then the
//! task's worker's); on a two-vCPU VM each was 0.3–0.9 ms of an execution's answer, five
//! times per execution (issue #18, measured with marks around each hop). On the
//! multi-threaded runtime [`run`] uses `block_in_place` instead: the work runs on the
//! current worker thread, whose other tasks move to another thread meanwhile, so no task
//! waits for it and the result needs no wake-up. Elsewhere (a current-thread runtime, as
//! unit tests use) it is the `spawn_blocking` hop, which never blocks that runtime's one
//! thread. Either way a panic in `f` comes back as [`Panicked`], as a failed task would.

use std::panic::{AssertUnwindSafe, catch_unwind};

use tokio::runtime::{Handle, RuntimeFlavor};

/// The blocking work panicked (or its pool task was cancelled at shutdown).
#[derive(Debug, thiserror::Error)]
#[error("the blocking task failed: {0}")]
pub struct Panicked(String);

/// Runs `f` for the caller; see the module documentation.
pub async fn run<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, Panicked> {
    let multi_threaded =
        Handle::try_current().is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if multi_threaded {
        tokio::task::block_in_place(|| catch_unwind(AssertUnwindSafe(f))).map_err(|payload| {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            Panicked(message)
        })
    } else {
        tokio::task::spawn_blocking(f).await.map_err(|e| Panicked(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_name() -> String {
        std::thread::current().name().unwrap_or("").to_owned()
    }

    #[test]
    fn on_the_multi_threaded_runtime_the_work_runs_on_the_awaiting_thread() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("worker")
            .build()
            .unwrap();
        let (outside, inside) = runtime.block_on(async {
            tokio::spawn(async { (thread_name(), run(thread_name).await.unwrap()) }).await.unwrap()
        });
        assert_eq!((outside.as_str(), inside.as_str()), ("worker", "worker"));
        // The pool's threads have the same name: the thread id tells them apart.
        let same = runtime.block_on(async {
            tokio::spawn(async {
                let here = std::thread::current().id();
                run(move || std::thread::current().id() == here).await.unwrap()
            })
            .await
            .unwrap()
        });
        assert!(same, "the work hopped to another thread");
    }

    #[test]
    fn a_panic_is_an_error_on_either_runtime() {
        let multi = tokio::runtime::Builder::new_multi_thread().worker_threads(1).build().unwrap();
        let error =
            multi.block_on(async { tokio::spawn(run(|| panic!("boom"))).await.unwrap() }).unwrap_err();
        assert_eq!(error.to_string(), "the blocking task failed: boom");
        let single = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let error = single.block_on(run(|| -> () { panic!("boom {}", 2) })).unwrap_err();
        assert!(error.to_string().contains("boom 2"), "{error}");
    }

    #[test]
    fn on_a_current_thread_runtime_the_work_leaves_the_runtime_thread() {
        let single = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let here = std::thread::current().id();
        let elsewhere = single.block_on(run(move || std::thread::current().id() != here)).unwrap();
        assert!(elsewhere);
    }
}
