//! Bulk CPU work, kept off the async runtime: a [`BulkThread`] of its own that async tasks
//! hand work to and await, and [`map_on_every_core`] to split a large piece of it across the
//! machine's cores (the first mesh snapshot's translation, the first read of a large mesh
//! file). The runtime's worker threads serve DNS and xDS; work that holds one for 100 ms (a
//! 10k-service translation) delays every query queued behind it, so none runs there.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;

/// Below this many items one thread does it all: spawning threads costs more than it saves.
pub const PARALLEL_FROM: usize = 512;

/// `f` of every item, in order; split across the machine's cores when there are many items.
/// Scoped threads rather than a thread pool crate: this runs once per large change (the first
/// snapshot and the first read of a large mesh file above all), the only bulk CPU work the
/// agent does, and a pool would keep threads for nothing the rest of the time.
///
/// It blocks its caller until every part is done: call it from a [`BulkThread`] or another
/// thread of its own, never from an async task.
pub fn map_on_every_core<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    // The count first: `available_parallelism` reads the cgroup's CPU quota from three files
    // on every call, and this runs on every snapshot, almost always with a few items.
    let cores = if items.len() < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism().map_or(1, usize::from)
    };
    if cores < 2 {
        return items.iter().map(f).collect();
    }
    let chunk = items.len().div_ceil(cores);
    let f = &f;
    std::thread::scope(|scope| {
        let others: Vec<_> = items
            .chunks(chunk)
            .skip(1)
            .map(|part| scope.spawn(move || part.iter().map(f).collect::<Vec<R>>()))
            .collect();
        let mut all: Vec<R> = Vec::with_capacity(items.len());
        all.extend(items[..chunk].iter().map(f));
        for other in others {
            match other.join() {
                Ok(part) => all.extend(part),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        all
    })
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread of its own that runs the jobs async tasks hand it, one at a time, and hands each
/// result back to the task that awaits it. The thread ends when the handle is dropped and its
/// queue is empty.
pub struct BulkThread {
    jobs: mpsc::Sender<Job>,
}

/// The bulk thread is gone: it could not be started, or it ended.
#[derive(Debug, thiserror::Error)]
pub enum BulkThreadError {
    #[error("cannot start the {name} thread: {source}")]
    Spawn {
        name: String,
        source: std::io::Error,
    },
    #[error("the bulk thread ended")]
    Gone,
}

impl BulkThread {
    pub fn spawn(name: &str) -> Result<BulkThread, BulkThreadError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in queue {
                    job();
                }
            })
            .map_err(|source| BulkThreadError::Spawn {
                name: name.to_string(),
                source,
            })?;
        Ok(BulkThread { jobs })
    }

    /// Runs `job` on the thread and waits for its result without holding a runtime worker. A
    /// panic in `job` is raised again here, in the awaiting task, as if it had run there.
    pub async fn run<R: Send + 'static>(
        &self,
        job: impl FnOnce() -> R + Send + 'static,
    ) -> Result<R, BulkThreadError> {
        let (done, result) = tokio::sync::oneshot::channel();
        let wrapped: Job = Box::new(move || {
            // The job's state is moved in and dropped here if it panics: nothing is observed
            // half-changed afterwards, so unwind safety holds.
            let _ = done.send(std::panic::catch_unwind(AssertUnwindSafe(job)));
        });
        self.jobs.send(wrapped).map_err(|_| BulkThreadError::Gone)?;
        match result.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => Err(BulkThreadError::Gone),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The awaiting task's runtime has one worker: if the job ran on it, the ticker could not
    /// tick until the job was over.
    #[tokio::test(flavor = "current_thread")]
    async fn a_job_runs_off_the_runtime_and_its_result_comes_back() {
        let thread = BulkThread::spawn("test-bulk").unwrap();
        let (release, gate) = mpsc::channel::<()>();
        let job = thread.run(move || {
            gate.recv().unwrap();
            std::thread::current().name().map(str::to_string)
        });
        let ticker = async move {
            tokio::task::yield_now().await;
            release.send(()).unwrap();
        };
        let both = async { tokio::join!(job, ticker) };
        let (name, ()) = tokio::time::timeout(std::time::Duration::from_secs(10), both)
            .await
            .expect("the job held the runtime's only worker");
        assert_eq!(name.unwrap().as_deref(), Some("test-bulk"));
    }

    #[tokio::test]
    #[should_panic(expected = "boom")]
    async fn a_panic_in_a_job_is_raised_in_the_awaiting_task() {
        let thread = BulkThread::spawn("test-bulk").unwrap();
        let _ = thread.run(|| panic!("boom")).await;
    }

    #[test]
    fn order_is_kept_however_the_items_are_split() {
        for n in [
            0,
            1,
            PARALLEL_FROM - 1,
            PARALLEL_FROM,
            2 * PARALLEL_FROM + 3,
        ] {
            let items: Vec<usize> = (0..n).collect();
            let doubled: Vec<usize> = items.iter().map(|i| i * 2).collect();
            assert_eq!(map_on_every_core(&items, |i| i * 2), doubled);
        }
    }
}
