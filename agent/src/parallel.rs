//! Bulk work split across the machine's cores, for the few places that do bulk work: the first
//! mesh snapshot's translation and the first read of a large mesh file, on the path of an
//! agent's start and restart, when nothing else runs yet.

/// Below this many items one thread does it all: spawning threads costs more than it saves.
pub const PARALLEL_FROM: usize = 512;

/// `f` of every item, in order; split across the machine's cores when there are many items.
/// Scoped threads rather than a thread pool crate: this runs once per large change (the first
/// snapshot and the first read of a large mesh file above all), the only bulk CPU work the
/// agent does, and a pool would keep threads for nothing the rest of the time.
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

#[cfg(test)]
mod tests {
    use super::*;

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
