//! The watches' lists against a plain model: random interleavings of lists (started, cut
//! short by a new start, completed), changes and deletions on a Services watch and an
//! EndpointSlices watch. Every published snapshot is what the completed lists and the changes
//! since say: nothing of a list shows before it completes, what it leaves out goes when it
//! does, and nothing is published before both watches have listed.

use std::collections::BTreeSet;

use kube::runtime::watcher;
use proptest::prelude::*;
use serde_json::json;

use super::tests::{View, ready, scopes, service, slice, slice_change, svc_change, view};
use super::{Ownership, WatchSet};
use crate::mesh::Protocol;

const SERVICES: usize = 3;
/// Slice `j` names Service `j % SERVICES` and holds the endpoint `10.0.0.{j + 1}`.
const SLICES: usize = 4;

#[derive(Clone, Copy, Debug)]
enum Step {
    Init,
    InitApply(usize),
    InitDone,
    Apply(usize),
    Delete(usize),
}

fn step() -> impl Strategy<Value = (usize, Step)> {
    let object = 0..SLICES;
    (
        0..2usize,
        prop_oneof![
            2 => Just(Step::Init),
            4 => object.clone().prop_map(Step::InitApply),
            2 => Just(Step::InitDone),
            3 => object.clone().prop_map(Step::Apply),
            2 => object.prop_map(Step::Delete),
        ],
    )
}

/// One watch as the watcher drives it: a list (`Init`, its objects, `InitDone`) before any
/// change, and a new list at any time.
#[derive(Default)]
struct WatchModel {
    /// The objects of the list in progress.
    listing: Option<BTreeSet<usize>>,
    /// What the completed list and the changes since say is there.
    held: BTreeSet<usize>,
    listed: bool,
}

impl WatchModel {
    /// Whether the watcher could deliver `step` now; if so, follows it.
    fn take(&mut self, step: Step) -> bool {
        match (step, &mut self.listing) {
            (Step::Init, _) => self.listing = Some(BTreeSet::new()),
            (Step::InitApply(i), Some(listing)) => {
                listing.insert(i);
            }
            (Step::InitDone, Some(_)) => {
                self.held = self.listing.take().unwrap_or_default();
                self.listed = true;
            }
            (Step::Apply(i), None) if self.listed => {
                self.held.insert(i);
            }
            (Step::Delete(i), None) if self.listed && self.held.contains(&i) => {
                self.held.remove(&i);
            }
            _ => return false,
        }
        true
    }
}

fn service_named(i: usize) -> k8s_openapi::api::core::v1::Service {
    service("a", &format!("s{i}"), json!([{"name": "http", "port": 80}]))
}

fn slice_numbered(j: usize) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    slice(
        "a",
        &format!("x{j}"),
        &format!("s{}", j % SERVICES),
        json!([{"name": "http", "port": 80}]),
        ready(&[&format!("10.0.0.{}", j + 1)]),
    )
}

/// The event of `step`, with `object` the object it names, as the watch reads it.
fn of<K>(step: Step, object: impl Fn(usize) -> K) -> watcher::Event<K> {
    match step {
        Step::Init => watcher::Event::Init,
        Step::InitApply(i) => watcher::Event::InitApply(object(i)),
        Step::InitDone => watcher::Event::InitDone,
        Step::Apply(i) => watcher::Event::Apply(object(i)),
        Step::Delete(i) => watcher::Event::Delete(object(i)),
    }
}

/// What the model's Services and slices make: each Service with the endpoints of the slices
/// that name it.
fn expected(services: &WatchModel, slices: &WatchModel) -> View {
    services
        .held
        .iter()
        .map(|i| {
            let mut endpoints: Vec<String> = slices
                .held
                .iter()
                .filter(|j| *j % SERVICES == *i)
                .map(|j| format!("10.0.0.{}:80", j + 1))
                .collect();
            endpoints.sort();
            (format!("/a/s{i}"), vec![(80, Protocol::Http, endpoints)])
        })
        .collect()
}

proptest! {
    #[test]
    fn published_snapshots_follow_the_completed_lists_and_the_changes_since(
        steps in proptest::collection::vec(step(), 1..50),
    ) {
        let mut watches = WatchSet::new(
            "240.240.0.0/16".parse().unwrap(),
            Ownership::default(),
            scopes(&[None]),
        );
        let mut models = [WatchModel::default(), WatchModel::default()];
        let mut published = None;
        // Both lists complete at the end, so that a snapshot is due.
        let end = [(0, Step::Init), (0, Step::InitDone), (1, Step::Init), (1, Step::InitDone)];
        let steps = steps.into_iter().chain(end);
        for (watch, step) in steps {
            // There are fewer Services than slices.
            if let (0, Step::Apply(i) | Step::Delete(i) | Step::InitApply(i)) = (watch, step)
                && i >= SERVICES
            {
                continue;
            }
            if !models[watch].take(step) {
                continue;
            }
            let event = if watch == 0 {
                svc_change(of(step, service_named))
            } else {
                slice_change(of(step, slice_numbered))
            };
            watches.handle(watch, event);
            let snapshot = watches.publishable();
            if !(models[0].listed && models[1].listed) {
                prop_assert!(snapshot.is_none(), "published before both lists completed");
                continue;
            }
            if let Some(snapshot) = snapshot {
                published = Some(view(&snapshot));
            }
            prop_assert_eq!(
                published.as_ref(),
                Some(&expected(&models[0], &models[1])),
                "after {:?} on watch {}", step, watch
            );
        }
    }
}
