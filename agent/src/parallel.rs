//! Bulk CPU work, kept off the serving threads and behind them: a [`BulkThread`] of its own
//! that async tasks hand work to and await, [`map_on_every_core`] to split a large piece of it
//! across the machine's cores (the first mesh snapshot's translation, the first read of a
//! large mesh file), and [`Retiring`] for what a translation replaced, freed there too. The
//! runtime's worker threads and the DNS threads serve; work that holds one for 100 ms (a
//! 10k-service translation) delays every query queued behind it, so none runs there, and the
//! bulk threads run at `SCHED_IDLE` ([`yield_to_serving`]), those the agent's start waits on
//! from when it first serves ([`BulkThread::spawn_urgent`]).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

/// Below this many items one thread does it all: spawning threads costs more than it saves.
pub const PARALLEL_FROM: usize = 512;

/// `f` of every item, in order; split across the machine's cores when there are many items.
/// Scoped threads rather than a thread pool crate: this runs once per large change (the first
/// snapshot and the first read of a large mesh file above all), the only bulk CPU work the
/// agent does, and a pool would keep threads for nothing the rest of the time.
///
/// The items are taken a block at a time by whichever thread is free, not halved ahead: on a
/// node's shared cores the system often runs something else on one of them, and a thread
/// held back so kept its half to itself while the other thread, done, left a core idle. A
/// profile of a 50k-service restart showed that tail on one core for the last 50 ms of the
/// Kubernetes source's first snapshot, with the agent's start waiting on it.
///
/// It blocks its caller until every part is done: call it from a [`BulkThread`] or another
/// thread of its own, or from an async task through [`off_the_runtime`], never from an async
/// task as is.
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
    let block = items
        .len()
        .div_ceil(cores * BLOCKS_PER_CORE)
        .max(PARALLEL_FROM / 8);
    let blocks: Vec<&[T]> = items.chunks(block).collect();
    let next = AtomicUsize::new(0);
    // Each thread's blocks, by their place among all blocks.
    let work = || {
        let mut done: Vec<(usize, Vec<R>)> = Vec::new();
        loop {
            let at = next.fetch_add(1, Ordering::Relaxed);
            let Some(part) = blocks.get(at) else {
                return done;
            };
            done.push((at, part.iter().map(&f).collect()));
        }
    };
    std::thread::scope(|scope| {
        let others: Vec<_> = (1..cores.min(blocks.len()))
            .map(|_| scope.spawn(work))
            .collect();
        let mut done = work();
        for other in others {
            match other.join() {
                Ok(part) => done.extend(part),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        done.sort_unstable_by_key(|(at, _)| *at);
        let mut all: Vec<R> = Vec::with_capacity(items.len());
        for (_, part) in done {
            all.extend(part);
        }
        all
    })
}

/// How many blocks [`map_on_every_core`] cuts per core: enough that a thread held back leaves
/// at most a small block behind, few enough that taking one costs nothing next to its work.
const BLOCKS_PER_CORE: usize = 16;

/// Runs `f`, bulk work of an async task that cannot be handed to a thread of its own (it
/// needs the task's state), without holding the runtime: on a multi-threaded runtime the
/// task's worker first hands its other tasks to the rest of the runtime (tokio's
/// `block_in_place`). On a current-thread runtime, which cannot, or off any runtime, `f` runs
/// as is. It costs a thread hand-over: for large pieces of work only.
pub fn off_the_runtime<R>(f: impl FnOnce() -> R) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Puts the calling thread in `SCHED_IDLE`: a thread of normal policy (the DNS server's, the
/// runtime's workers) that wakes preempts it, instead of waiting for the end of its slice or
/// the next tick (up to 4 ms at HZ=250 on a kernel without preemption, which is what a DNS
/// query waited behind a translation). It is a tiny weight, not a strict priority: a woken
/// thread that has had more than its share can still wait for the tick, rarely. Threads it
/// spawns inherit the policy, so the parts of [`map_on_every_core`] run at it too. The share
/// against the rest of the node is the agent's cgroup's; inside it, bulk work runs on what
/// the serving threads leave. Lowering a thread's policy needs no privilege; if it fails all
/// the same, the thread runs at normal policy and says so.
pub fn yield_to_serving() {
    use thread_priority::ThreadPriority;
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id,
    };
    if let Err(error) = set_thread_priority_and_policy(
        thread_native_id(),
        ThreadPriority::Min,
        ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle),
    ) {
        tracing::warn!(%error, "bulk work runs at normal priority: cannot set SCHED_IDLE");
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// A thread of its own that runs the jobs async tasks hand it, one at a time, and hands each
/// result back to the task that awaits it. The thread ends when the handle is dropped and its
/// queue is empty.
pub struct BulkThread {
    jobs: mpsc::Sender<Job>,
    /// Whether the thread is (or has been asked to go) at `SCHED_IDLE`.
    settled: AtomicBool,
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
    /// A bulk thread at `SCHED_IDLE` from its start.
    pub fn spawn(name: &str) -> Result<BulkThread, BulkThreadError> {
        Self::spawn_at(name, true)
    }

    /// A bulk thread that starts at normal policy, for work the agent's start waits on: an
    /// agent that serves nothing yet has no query to yield to but those its node's last mesh
    /// answers, and its first snapshot is what every reconnecting proxy waits for. At
    /// `SCHED_IDLE` the first lists' decoding and the proxies' reconnect requests, at normal
    /// policy, left it only what they did not use. [`BulkThread::settle`] lowers it for good.
    pub fn spawn_urgent(name: &str) -> Result<BulkThread, BulkThreadError> {
        Self::spawn_at(name, false)
    }

    fn spawn_at(name: &str, idle: bool) -> Result<BulkThread, BulkThreadError> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                if idle {
                    yield_to_serving();
                }
                for job in queue {
                    job();
                }
            })
            .map_err(|source| BulkThreadError::Spawn {
                name: name.to_string(),
                source,
            })?;
        Ok(BulkThread {
            jobs,
            settled: AtomicBool::new(idle),
        })
    }

    /// Puts the thread at `SCHED_IDLE` after the jobs before it, for good (a thread cannot
    /// raise its own policy back without privilege): once the agent serves. Only the first
    /// call does anything, so a caller may call it on every snapshot.
    pub fn settle(&self) {
        if !self.settled.swap(true, Ordering::Relaxed) {
            let _ = self.jobs.send(Box::new(yield_to_serving));
        }
    }

    /// Drops `value` on the thread, after the jobs before it, without waiting: for large
    /// values whose freeing would hold a serving thread. If the thread is gone it is dropped
    /// here.
    pub fn drop_later<V: Send + 'static>(&self, value: V) {
        let _ = self.jobs.send(Box::new(move || drop(value)));
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

/// Values published to serving threads (a name table, Envoy resources, a mesh snapshot), held
/// after they are replaced until no serving thread holds them any more, so that none of those
/// threads drops the last reference. Freeing a 10k-service name table takes a DNS thread about
/// 2 ms, during which its socket is not read; freed on a bulk thread instead, it costs the
/// serving threads nothing. A serving thread holds one value at a time and lets go of it when
/// it takes the next, so at most one more value per serving thread is alive than without this.
pub struct Retiring<T> {
    held: Vec<Arc<T>>,
}

impl<T> Default for Retiring<T> {
    fn default() -> Self {
        Retiring { held: Vec::new() }
    }
}

impl<T> Retiring<T> {
    pub fn retire(&mut self, value: Arc<T>) {
        self.held.push(value);
    }

    /// The values only this still holds, taken out to be dropped off the serving threads.
    /// No one can take another reference to them: they were replaced where they were
    /// published, and this holds the only one left.
    pub fn released(&mut self) -> Vec<Arc<T>> {
        let (released, held) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|value| Arc::strong_count(value) == 1);
        self.held = held;
        released
    }

    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
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

    /// The bulk thread, and the threads it splits work across, run at `SCHED_IDLE`: serving
    /// threads preempt them.
    #[tokio::test]
    async fn bulk_work_runs_behind_the_serving_threads() {
        use thread_priority::unix::{
            NormalThreadSchedulePolicy, ThreadSchedulePolicy, thread_schedule_policy,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        let thread = BulkThread::spawn("test-bulk").unwrap();
        let policies = thread
            .run(|| {
                let items: Vec<usize> = (0..2 * PARALLEL_FROM).collect();
                map_on_every_core(&items, |_| thread_schedule_policy().unwrap())
            })
            .await
            .unwrap();
        assert!(
            policies.iter().all(|policy| *policy == idle),
            "{policies:?}"
        );
        assert_ne!(
            thread_schedule_policy().unwrap(),
            idle,
            "the awaiting thread's own policy was changed"
        );
    }

    /// An urgent bulk thread, and the threads it splits work across, run at normal policy
    /// until it is settled, and at `SCHED_IDLE` from then on.
    #[tokio::test]
    async fn an_urgent_bulk_thread_yields_once_settled() {
        use thread_priority::unix::{
            NormalThreadSchedulePolicy, ThreadSchedulePolicy, thread_schedule_policy,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        let policies = || {
            let items: Vec<usize> = (0..2 * PARALLEL_FROM).collect();
            map_on_every_core(&items, |_| thread_schedule_policy().unwrap())
        };
        let thread = BulkThread::spawn_urgent("test-urgent").unwrap();
        let before = thread.run(policies).await.unwrap();
        assert!(before.iter().all(|policy| *policy != idle), "{before:?}");
        thread.settle();
        let after = thread.run(policies).await.unwrap();
        assert!(after.iter().all(|policy| *policy == idle), "{after:?}");
    }

    #[tokio::test]
    #[should_panic(expected = "boom")]
    async fn a_panic_in_a_job_is_raised_in_the_awaiting_task() {
        let thread = BulkThread::spawn("test-bulk").unwrap();
        let _ = thread.run(|| panic!("boom")).await;
    }

    /// The runtime has one worker, and the task that blocks in `off_the_runtime` runs on it:
    /// the ticker can tick only if the worker handed it over first.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn off_the_runtime_lets_the_runtime_go_on() {
        let (ticked, tick) = mpsc::channel::<()>();
        let blocked = tokio::spawn(async move {
            off_the_runtime(|| tick.recv_timeout(std::time::Duration::from_secs(10)))
        });
        tokio::task::yield_now().await;
        let ticker = tokio::spawn(async move { ticked.send(()) });
        assert!(blocked.await.unwrap().is_ok(), "the ticker could not tick");
        ticker.await.unwrap().unwrap();
    }

    /// On a current-thread runtime, which cannot hand its tasks over, the work just runs.
    #[tokio::test(flavor = "current_thread")]
    async fn off_the_runtime_runs_in_place_on_one_thread() {
        assert_eq!(off_the_runtime(|| 7), 7);
    }

    #[test]
    fn order_is_kept_however_the_items_are_split() {
        for n in [
            0,
            1,
            PARALLEL_FROM - 1,
            PARALLEL_FROM,
            2 * PARALLEL_FROM + 3,
            PARALLEL_FROM * BLOCKS_PER_CORE * 3 + 17,
        ] {
            let items: Vec<usize> = (0..n).collect();
            let doubled: Vec<usize> = items.iter().map(|i| i * 2).collect();
            assert_eq!(map_on_every_core(&items, |i| i * 2), doubled);
        }
    }

    /// A thread that is held back (here: the one that takes the first block, until another
    /// has done the last item) leaves the blocks it has not taken to the others, instead of
    /// keeping a share fixed ahead.
    #[test]
    fn a_thread_held_back_leaves_its_share_to_the_others() {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if cores < 2 {
            return;
        }
        let items: Vec<usize> = (0..PARALLEL_FROM * BLOCKS_PER_CORE).collect();
        let last = items.len() - 1;
        let (release, held) = mpsc::channel::<()>();
        let held = std::sync::Mutex::new(held);
        let release = std::sync::Mutex::new(release);
        let first = std::sync::OnceLock::new();
        let threads = map_on_every_core(&items, |&i| {
            let here = std::thread::current().id();
            if i == 0 {
                first.set(here).unwrap();
                // Bounded, so that a split that kept the last item for this thread fails
                // below rather than hangs.
                let _ = held
                    .lock()
                    .unwrap()
                    .recv_timeout(std::time::Duration::from_secs(30));
            } else if i == last {
                let _ = release.lock().unwrap().send(());
            }
            here
        });
        assert_eq!(threads.len(), items.len());
        let held = first.get().unwrap();
        let by_held = threads.iter().filter(|&t| t == held).count();
        assert!(by_held < items.len() / 2, "{by_held} of {}", items.len());
        assert!(
            threads[..by_held].iter().all(|t| t == held),
            "its first block only"
        );
    }

    #[test]
    fn a_retired_value_is_released_once_no_one_else_holds_it() {
        let mut retiring = Retiring::default();
        let reader = Arc::new("table");
        retiring.retire(reader.clone());
        retiring.retire(Arc::new("newer"));
        let released = retiring.released();
        assert_eq!(released.iter().map(|v| **v).collect::<Vec<_>>(), ["newer"]);
        assert!(!retiring.is_empty(), "a reader still holds the older one");
        drop(reader);
        assert_eq!(retiring.released().len(), 1);
        assert!(retiring.is_empty());
    }
}
