//! Reading the mesh file by what an edit changed.
//!
//! At 10k services the file is about 4 MB of YAML. Reading all of it through `serde_norway`
//! took three quarters of the agent's CPU per edit, so the text is cut into its `services`
//! items ([`super::items`]) and each is read alone; and since an edit of one service must
//! cost that service's work, not the file's, the reader keeps the last good read (its text,
//! where its items start, what each read as) and finds what an edit changed from the text the
//! two share at their start and end. The result is then the services to remove and to upsert,
//! which the mesh state applies without comparing the other 10k.
//!
//! Every shortcut either gives what reading the whole file gives or steps aside: an edit that
//! reaches the first item, a file with routing rules (they name other services' ports, so an
//! edit of one service can change whether another's rules hold), or items that do not read
//! or validate alone all go to the whole-file reading, whose errors name the place in the
//! whole file.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::limits::{self, Limits};
use super::{FileService, ReadService, assemble, items, parse, read_service};
use crate::mesh::{MeshPath, Provider, ServiceSpec};
use crate::parallel;

/// What a read gives the mesh state.
#[derive(Debug, PartialEq)]
pub(super) enum Read {
    /// Every service of the file: the state becomes exactly these.
    Whole(Vec<ServiceSpec>),
    /// What changed: the services at `removed` left, `upserted` are new or changed, and every
    /// other service of the file is as it was.
    Edit {
        removed: Vec<MeshPath>,
        upserted: Vec<ServiceSpec>,
    },
}

/// Reads the file's text into services; see the module's documentation.
pub(super) struct Reader {
    provider: Provider,
    limits: Limits,
    /// The last read the mesh state took, if its layout was one that is cut into items.
    last: Option<LastRead>,
    /// The last read the mesh state took otherwise: its text and services, for the file's
    /// copy; kept only when there is one ([`Self::keeping_whole_reads`]).
    plain: Option<(String, Vec<ServiceSpec>)>,
    /// Whether a text read whole is kept for the file's copy. Without a copy nothing asks for
    /// it, and keeping it would cost a copy of the text and of its services at every read.
    keep_plain: bool,
    /// The last read, until the mesh state takes it ([`Self::commit`]): an edit the state
    /// refuses (no address left) must not become the text the next edit is compared with.
    pending: Option<Pending>,
    /// The buffer of a text that gave way to a newer one, to copy the next read into: a fresh
    /// 4 MB string per edit cost a page fault per 4 KiB page (perf).
    spare: String,
}

/// A good read of a text cut into items.
struct LastRead {
    text: String,
    /// Where each item starts in `text`.
    starts: Vec<usize>,
    /// What each item read as.
    services: Vec<Arc<ReadService>>,
    /// Every item's path: a changed item must not take a path another item has.
    /// Persistent, so an edit's copy is cheap.
    paths: imbl::HashSet<MeshPath>,
    /// Whether any item has routing rules.
    routes: bool,
}

enum Pending {
    Whole(LastRead),
    /// A text read whole, not cut into items; with its services when they are kept.
    Plain(Option<(String, Vec<ServiceSpec>)>),
    /// The items `edit.first..edit.end` of the last read gave way to `services`, starting at
    /// `edit.starts`; the items after them moved by `edit.shift` bytes.
    Edit {
        text: String,
        edit: items::Edit,
        services: Vec<Arc<ReadService>>,
        paths: imbl::HashSet<MeshPath>,
    },
}

impl Reader {
    pub(super) fn new(provider: Provider, limits: Limits) -> Self {
        Reader {
            provider,
            limits,
            last: None,
            plain: None,
            keep_plain: false,
            pending: None,
            spare: String::new(),
        }
    }

    /// Keeps the last text read whole, and its services, for [`Self::kept`]: the file has a
    /// copy to write.
    pub(super) fn keeping_whole_reads(mut self) -> Self {
        self.keep_plain = true;
        self
    }

    /// Reads `text` as the file's new content; errors are the whole file's, as [`parse`]
    /// gives them. The state must [`Self::commit`] the read once it has applied it.
    pub(super) fn read(&mut self, text: &str) -> Result<Read, String> {
        self.pending = None;
        if let Some(read) = self.read_edit(text) {
            return Ok(read);
        }
        if let Some(starts) = items::split(text)
            && let Some(specs) = self.read_items(text, starts)
        {
            return Ok(Read::Whole(specs));
        }
        let specs = parse(text, &self.provider, &self.limits)?;
        self.pending = Some(match self.keep_plain {
            true => Pending::Plain(Some((text.to_owned(), specs.clone()))),
            false => Pending::Plain(None),
        });
        tracing::debug!(
            "mesh file read as a whole: its layout is not one whose items are read one by one"
        );
        Ok(Read::Whole(specs))
    }

    /// The mesh state took the last read: the next edit is compared with it.
    pub(super) fn commit(&mut self) {
        match self.pending.take() {
            None => {}
            Some(Pending::Whole(last)) => {
                self.last = Some(last);
                self.plain = None;
            }
            Some(Pending::Plain(kept)) => {
                self.last = None;
                self.plain = kept;
            }
            Some(Pending::Edit {
                text,
                edit,
                services,
                paths,
            }) => {
                let Some(last) = &mut self.last else { return };
                let items::Edit {
                    first,
                    end,
                    starts,
                    shift,
                    ..
                } = edit;
                for start in &mut last.starts[end..] {
                    *start = start.wrapping_add_signed(shift);
                }
                last.starts.splice(first..end, starts);
                last.services.splice(first..end, services);
                self.spare = std::mem::replace(&mut last.text, text);
                last.paths = paths;
            }
        }
    }

    /// The text of the last read the state took and its services in the file's order, as
    /// reading it whole gives them.
    pub(super) fn kept(&self) -> Option<(&str, Vec<ServiceSpec>)> {
        match (&self.last, &self.plain) {
            (Some(last), _) => Some((&last.text, assemble(&last.services).ok()?)),
            (None, Some((text, specs))) => Some((text, specs.clone())),
            (None, None) => None,
        }
    }

    /// The read of an edit of the last read, by the items it changed; `None` where the whole
    /// text must be read instead.
    fn read_edit(&mut self, text: &str) -> Option<Read> {
        let last = self.last.as_ref().filter(|last| !last.routes)?;
        let edit = items::edit(&last.text, &last.starts, text)?;
        let old = &last.services[edit.first..edit.end];
        // Items of the changed stretch whose text did not change (often the one the first
        // difference falls in is cut again whole, its text the same) keep their reading.
        let old_texts: HashMap<&str, &Arc<ReadService>> = (edit.first..edit.end)
            .map(|k| items::item(&last.text, &last.starts, k))
            .zip(old)
            .collect();
        let mut services = Vec::with_capacity(edit.starts.len());
        let mut upserted = Vec::new();
        for k in 0..edit.starts.len() {
            let item = edit.item(text, k);
            let service = match old_texts.get(item) {
                Some(&service) => service.clone(),
                None => {
                    let service = read_item(edit.first + k, item, &self.provider, &self.limits)?;
                    if !service.routes.is_empty() {
                        return None;
                    }
                    upserted.push(service.spec.clone());
                    Arc::new(service)
                }
            };
            services.push(service);
        }
        // A path may be taken by one item only.
        let leaving: HashSet<&MeshPath> = old.iter().map(|s| &s.spec.path).collect();
        let mut arriving = HashSet::with_capacity(services.len());
        for service in &services {
            let path = &service.spec.path;
            let elsewhere = last.paths.contains(path) && !leaving.contains(path);
            if elsewhere || !arriving.insert(path) {
                return None;
            }
        }
        let removed: Vec<MeshPath> = leaving
            .iter()
            .filter(|path| !arriving.contains(*path))
            .map(|path| (*path).clone())
            .collect();
        let mut paths = last.paths.clone();
        for path in &removed {
            paths.remove(path);
        }
        for path in arriving {
            paths.insert(path.clone());
        }
        let mut copy = std::mem::take(&mut self.spare);
        copy.clear();
        copy.push_str(text);
        self.pending = Some(Pending::Edit {
            text: copy,
            edit,
            services,
            paths,
        });
        Some(Read::Edit { removed, upserted })
    }

    /// The services of the items of `text` starting at `starts`, reading only those whose text
    /// the last read did not have; `None` where the whole text must be read instead.
    fn read_items(&mut self, text: &str, starts: Vec<usize>) -> Option<Vec<ServiceSpec>> {
        let texts: Vec<&str> = (0..starts.len())
            .map(|k| items::item(text, &starts, k))
            .collect();
        let known: HashMap<&str, &Arc<ReadService>, foldhash::fast::RandomState> = match &self.last
        {
            Some(last) => (0..last.starts.len())
                .map(|k| items::item(&last.text, &last.starts, k))
                .zip(&last.services)
                .collect(),
            None => HashMap::default(),
        };
        // The new items are read first, on every core when there are many (the first read of
        // a large file).
        let new: Vec<(usize, &str)> = texts
            .iter()
            .copied()
            .enumerate()
            .filter(|(_, item)| !known.contains_key(item))
            .collect();
        let (provider, limits) = (&self.provider, &self.limits);
        let mut read =
            parallel::map_on_every_core(&new, |&(i, item)| read_item(i, item, provider, limits))
                .into_iter();
        let services = texts
            .iter()
            .map(|item| match known.get(item) {
                Some(&service) => Some(service.clone()),
                None => read.next().flatten().map(Arc::new),
            })
            .collect::<Option<Vec<Arc<ReadService>>>>()?;
        drop(known);
        let specs = assemble(&services).ok()?;
        self.pending = Some(Pending::Whole(LastRead {
            text: text.to_owned(),
            starts,
            routes: services.iter().any(|s| !s.routes.is_empty()),
            paths: services.iter().map(|s| s.spec.path.clone()).collect(),
            services,
        }));
        Some(specs)
    }
}

/// One item's text (a YAML block sequence of one entry) as the `i`th service of the file;
/// `None` for one past a limit too, which the whole-file reading then names.
fn read_item(i: usize, item: &str, provider: &Provider, limits: &Limits) -> Option<ReadService> {
    // The item is an entry of the `services` list, two levels down.
    limits::check(item, limits, 2).ok()?;
    let mut list: Vec<FileService> = serde_norway::from_str(item).ok()?;
    let service = list.pop().filter(|_| list.is_empty())?;
    read_service(i, service, provider).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mesh::MeshState;
    use crate::source::file::tests::GOOD;

    fn parse(text: &str) -> Result<Vec<ServiceSpec>, String> {
        super::parse(text, &Provider::new("file:test"), &Limits::default())
    }

    /// A file with every kind of item the reader splits: rules naming other services, a
    /// stateful service, host names, health, comments between items.
    fn varied_file() -> String {
        varied_file_with(true)
    }

    /// [`varied_file`], with or without its routing rules.
    fn varied_file_with(routes: bool) -> String {
        let mut text = String::from("# generated\nservices:\n");
        for i in 0..30 {
            text.push_str(&format!(
                "  # service {i}\n  - path: /ns{n}/svc{i}\n    ports:\n      - port: 80\n        protocol: http\n        targetPort: {target}\n    endpoints:\n      - address: 10.1.{n}.{i}\n        zone: z{n}\n      - address: 10.2.{n}.{i}\n",
                n = i % 3,
                target = 8000 + i
            ));
            if routes && i % 10 == 1 {
                text.push_str(&format!(
                    "    routes:\n      - matches: [{{path: {{prefix: /v2}}}}]\n        backends:\n          - service: /ns{n}/svc{next}\n            weight: 90\n          - service: /ns{n2}/svc{i}\n            weight: 10\n",
                    n = (i + 1) % 3,
                    next = i + 1,
                    n2 = i % 3,
                ));
            }
        }
        text.push_str("  - path: /db/pg\n    ports: [{port: 5432}]\n    endpoints:\n      - {address: 10.3.0.1, name: pg-0}\n      - {address: 10.3.0.2, name: pg-1, ready: false}\n");
        text.push_str("  - path: /ext/api\n    ports:\n      - port: 443\n    endpoints:\n      - address: api.example.com\n    health:\n      check:\n        tcp: {}\n        interval: 5s\n    clients: [\"web/front*\"]\n");
        text
    }

    fn reader() -> Reader {
        Reader::new(Provider::new("file:test"), Limits::default())
    }

    /// A reader and the mesh state it feeds, beside a state that takes every text whole.
    struct Pair {
        reader: Reader,
        state: MeshState,
        whole: MeshState,
    }

    impl Pair {
        fn new() -> Self {
            let trap = "10.0.0.0/16".parse().unwrap();
            Pair {
                reader: reader(),
                state: MeshState::new(trap),
                whole: MeshState::new("10.0.0.0/16".parse().unwrap()),
            }
        }

        /// Reads and applies `text` both ways; the read, for the caller to look at.
        fn read(&mut self, text: &str) -> Read {
            let read = self.reader.read(text).unwrap();
            match &read {
                Read::Whole(specs) => self.state.replace_all(specs.clone()),
                Read::Edit { removed, upserted } => self.state.apply(removed, upserted.clone()),
            }
            .unwrap();
            self.reader.commit();
            self.whole.replace_all(parse(text).unwrap()).unwrap();
            let (ours, whole) = (self.state.snapshot(), self.whole.snapshot());
            assert_eq!(ours.services, whole.services, "{text}");
            read
        }
    }

    #[test]
    fn reading_by_items_gives_what_reading_the_whole_gives() {
        let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
        // Enough items for the first read to run on every core.
        let mut large = String::from("services:\n");
        for i in 0..crate::parallel::PARALLEL_FROM + 100 {
            large.push_str(&format!(
                "- path: /big/s{i}\n  ports: [{{port: 80, protocol: http}}]\n  endpoints: [{{address: 10.9.{}.{}}}]\n",
                i / 250,
                i % 250
            ));
        }
        let mut texts = vec![GOOD.to_string(), varied_file(), large];
        for file in ["mesh.yaml", "blue-green.yaml"] {
            texts.push(std::fs::read_to_string(format!("{examples}/{file}")).unwrap());
        }
        for text in &texts {
            let starts = items::split(text).expect("a plain layout splits");
            let mut reader = reader();
            assert_eq!(
                reader.read(text).unwrap(),
                Read::Whole(parse(text).unwrap())
            );
            reader.commit();
            let last = reader.last.as_ref().expect("the read is kept");
            assert_eq!(last.starts, starts, "every item is kept");
        }
    }

    #[test]
    fn a_text_read_whole_is_kept_only_for_a_copy() {
        let text =
            "{services: [{path: /a/b, ports: [{port: 80}], endpoints: [{address: 10.0.0.1}]}]}\n";
        assert!(items::split(text).is_none(), "a layout not cut into items");
        let mut plain = reader();
        plain.read(text).unwrap();
        plain.commit();
        assert!(plain.kept().is_none(), "no copy, nothing kept");

        let mut copied = reader().keeping_whole_reads();
        let specs = parse(text).unwrap();
        assert_eq!(copied.read(text).unwrap(), Read::Whole(specs.clone()));
        assert!(copied.kept().is_none(), "not before the state takes it");
        copied.commit();
        assert_eq!(copied.kept(), Some((text, specs)));
    }

    /// Edits of a file without rules: each is read as the services it removed and changed,
    /// and the state they make is the state the whole text makes.
    #[test]
    fn an_edit_reads_only_the_items_it_changed() {
        let mut pair = Pair::new();
        let text = varied_file_with(false);
        assert!(matches!(pair.read(&text), Read::Whole(_)));
        let path = |p: &str| p.parse::<MeshPath>().unwrap();
        let paths = |specs: &[ServiceSpec]| {
            let mut paths: Vec<&str> = specs.iter().map(|s| s.path.as_str()).collect();
            paths.sort();
            paths.into_iter().map(String::from).collect::<Vec<_>>()
        };

        // One endpoint of one service moves.
        let moved = text.replace("10.2.1.4\n", "10.2.1.99\n");
        let Read::Edit { removed, upserted } = pair.read(&moved) else {
            panic!("an edit of one item is read by its items");
        };
        assert!(removed.is_empty());
        assert_eq!(paths(&upserted), ["/ns1/svc4"]);

        // A service added between two others, and one renamed, in one write.
        let edited = moved
            .replace(
                "  - path: /db/pg",
                "  - path: /new/one\n    ports: [{port: 81}]\n  - path: /db/pg",
            )
            .replace("  - path: /ns2/svc5\n", "  - path: /ns2/svc5x\n");
        let Read::Edit { removed, upserted } = pair.read(&edited) else {
            panic!("an edit of a few items is read by its items");
        };
        assert_eq!(removed, [path("/ns2/svc5")]);
        assert_eq!(paths(&upserted), ["/new/one", "/ns2/svc5x"]);

        // The last service removed; the first one changed.
        let last = edited.find("  - path: /ext/api").unwrap();
        let shorter = edited[..last].replace("10.1.0.0\n", "10.1.0.200\n");
        let Read::Edit { removed, upserted } = pair.read(&shorter) else {
            panic!("an edit at both ends is read by its items");
        };
        assert_eq!(removed, [path("/ext/api")]);
        assert_eq!(paths(&upserted), ["/ns0/svc0"]);

        // The same text again changes nothing.
        assert_eq!(
            pair.read(&shorter),
            Read::Edit {
                removed: Vec::new(),
                upserted: Vec::new()
            }
        );
        // A service moved elsewhere in the file is read again, and stays.
        let svc7 = "  # service 7\n  - path: /ns1/svc7\n    ports:\n      - port: 80\n        protocol: http\n        targetPort: 8007\n    endpoints:\n      - address: 10.1.1.7\n        zone: z1\n      - address: 10.2.1.7\n";
        assert!(shorter.contains(svc7));
        let reordered = format!("{}{svc7}", shorter.replace(svc7, ""));
        pair.read(&reordered);
    }

    /// With rules, an edit of one service can change whether another's rules hold: the whole
    /// text is read.
    #[test]
    fn a_file_with_rules_is_read_whole() {
        let mut pair = Pair::new();
        let text = varied_file();
        pair.read(&text);
        let edited = text.replace("10.2.1.4\n", "10.2.1.99\n");
        assert!(matches!(pair.read(&edited), Read::Whole(_)));
        // An edit that brings the first rule into a file without any.
        let mut pair = Pair::new();
        let plain = varied_file_with(false);
        pair.read(&plain);
        let with_rule = plain.replace(
            "        targetPort: 8004\n",
            "        targetPort: 8004\n    routes:\n      - backends: [{service: /ns0/svc3}]\n",
        );
        assert!(matches!(pair.read(&with_rule), Read::Whole(_)));
    }

    #[test]
    fn a_bad_edit_is_refused_with_the_whole_files_message_and_the_last_read_stays() {
        for routes in [true, false] {
            let mut pair = Pair::new();
            let text = varied_file_with(routes);
            pair.read(&text);
            let mut bad = vec![
                // A service of the same path twice: each item reads alone, the whole does not.
                text.replace("/ns2/svc5\n", "/ns1/svc4\n"),
                // Not YAML in one item.
                text.replace("targetPort: 8004", "targetPort: [8004"),
                // A bad port in one item.
                text.replace("port: 5432", "port: 70000"),
                // Another key after the services.
                format!("{text}other: 1\n"),
            ];
            if routes {
                // A rule naming a service that is not there.
                bad.push(text.replace("service: /ns2/svc2", "service: /ns2/nothing"));
            }
            for bad in bad {
                assert_eq!(
                    pair.reader.read(&bad).unwrap_err(),
                    parse(&bad).unwrap_err()
                );
            }
            // The next good edit is read against the last good text.
            let good = text.replace("10.2.1.4\n", "10.2.1.98\n");
            let read = pair.read(&good);
            assert_eq!(matches!(read, Read::Edit { .. }), !routes);
            // A quoted string that spans an item boundary reads as the whole file reads it.
            let spanning = good.replace(
                "  - path: /db/pg",
                "  - path: /q/s\n    ports: [{port: 82, name: \"a\n  - b\"}]\n  - path: /db/pg",
            );
            assert_eq!(
                pair.reader.read(&spanning).map(|_| ()),
                parse(&spanning).map(|_| ())
            );
        }
    }

    /// A read the mesh state did not take (it ran out of addresses) is not the text the next
    /// edit is compared with.
    #[test]
    fn a_read_the_state_refused_is_not_the_base_of_the_next() {
        let mut pair = Pair::new();
        let text = varied_file_with(false);
        pair.read(&text);
        let refused = text.replace("/ns2/svc5\n", "/ns2/svc5x\n");
        assert!(matches!(
            pair.reader.read(&refused).unwrap(),
            Read::Edit { .. }
        ));
        // Not committed: this edit, of another service, leaves svc5 as it is.
        let next = text.replace("10.2.1.4\n", "10.2.1.97\n");
        let Read::Edit { removed, upserted } = pair.read(&next) else {
            panic!("read by its items");
        };
        assert!(removed.is_empty());
        assert_eq!(upserted.len(), 1);
        assert_eq!(upserted[0].path.as_str(), "/ns1/svc4");
    }

    /// Random edits of a large file, each applied both ways: the same mesh every time.
    #[test]
    fn many_edits_make_the_mesh_the_whole_text_makes() {
        let mut pair = Pair::new();
        let mut text = varied_file_with(false);
        pair.read(&text);
        let mut seed = 7u64;
        let mut next = |bound: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            usize::try_from(seed >> 33).unwrap() % bound
        };
        let mut edits = 0;
        for round in 0..200 {
            let services: Vec<usize> = text.match_indices("  - path: ").map(|(i, _)| i).collect();
            let at = services[next(services.len())];
            let line_end = at + text[at..].find('\n').unwrap();
            let candidate = match next(4) {
                // Rename a service.
                0 => format!("{}-e{round}{}", &text[..line_end], &text[line_end..]),
                // Add one before it.
                1 => format!(
                    "{}  - path: /added/r{round}\n    ports: [{{port: 80}}]\n{}",
                    &text[..at],
                    &text[at..]
                ),
                // Remove it (up to the next one).
                2 => match services.iter().find(|&&s| s > at) {
                    Some(&end) if services.len() > 2 => {
                        format!("{}{}", &text[..at], &text[end..])
                    }
                    _ => continue,
                },
                // Change an endpoint address (10.x to 12.x and back).
                _ => {
                    let Some(found) = text[at..].find("address: 1") else {
                        continue;
                    };
                    let digit = at + found + "address: 1".len();
                    let other = if &text[digit..=digit] == "0" {
                        "2"
                    } else {
                        "0"
                    };
                    format!("{}{other}{}", &text[..digit], &text[digit + 1..])
                }
            };
            if parse(&candidate).is_err() {
                continue;
            }
            if matches!(pair.read(&candidate), Read::Edit { .. }) {
                edits += 1;
            }
            text = candidate;
        }
        assert!(edits > 100, "{edits} edits read by their items");
    }
}
