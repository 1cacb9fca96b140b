//! The `services` items of a mesh file as separate texts, so that an edit re-reads only the
//! items whose text changed; and which items those are, found from what the old and the new
//! text share at their ends ([`edit`]).
//!
//! A 10k-service file is about 4 MB of YAML, and reading it through `serde_norway` took three
//! quarters of the agent's CPU for each edit (a profile of the benchmark's edits). Splitting the
//! text at its item boundaries is a scan of the lines; each item is then YAML on its own (a
//! block sequence of one entry) whose reading can be kept by its text.
//!
//! Only a plain layout is split; anything else is read as a whole, as before:
//! - the only key at column 0 is `services:` (a comment may follow it), with the items below it
//!   in block style, each starting with `- ` at one indentation;
//! - no anchor, alias or tag anywhere (`&`, `*` or `!` at the start of a token), since those
//!   tie items together, and no tab.
//!
//! A cut can still land inside a value that YAML would continue across it (a quoted string or
//! a flow collection that spans lines); the item before such a cut is then not valid YAML by
//! itself, and the caller reads the whole file instead. So a split either reads exactly as the
//! whole text does or fails.

/// Where the file's `services` items start, in order; each runs from its `- ` line to the line
/// before the next item (comments and blank lines included), the last to the end of the text.
/// `None` when the layout is not one this module splits, or the list is empty.
pub(super) fn split(text: &str) -> Option<Vec<usize>> {
    // The lines that are not blank nor comments, with their offsets.
    let mut lines = text
        .split_inclusive('\n')
        .scan(0, |offset, line| {
            let here = *offset;
            *offset += line.len();
            Some((here, line.trim_end_matches(['\n', '\r'])))
        })
        .filter(|(_, content)| {
            let trimmed = content.trim_start_matches(' ');
            !trimmed.is_empty() && !trimmed.starts_with('#')
        });
    // The key, alone at column 0; then the first item, whose line gives the indentation.
    let (_, key) = lines.next()?;
    if !is_services_key(key) || key.contains('\t') || has_node_property(key) {
        return None;
    }
    let (start, first) = lines.next()?;
    let indent = first.len() - first.trim_start_matches(' ').len();
    cut(text, start, text.len(), indent)
}

/// The item starts in `text[from..to]`, which must begin with an item's `- ` line at `indent`
/// and end at a line's end; `None` when a line there is not an item of this layout (less
/// indented, another key, a tab, an anchor, alias or tag).
fn cut(text: &str, from: usize, to: usize, indent: usize) -> Option<Vec<usize>> {
    let region = &text[from..to];
    // Most files have none of these characters; only then is every line looked at for them.
    let check_lines = has_odd_byte(region);
    let mut starts = Vec::new();
    let mut offset = from;
    for line in region.split_inclusive('\n') {
        let here = offset;
        offset += line.len();
        let content = line.trim_end_matches(['\n', '\r']);
        let trimmed = content.trim_start_matches(' ');
        if trimmed.is_empty() || trimmed.starts_with('#') {
            continue;
        }
        if check_lines && (content.contains('\t') || has_node_property(content)) {
            return None;
        }
        let column = content.len() - trimmed.len();
        let starts_item = trimmed == "-" || trimmed.starts_with("- ");
        match column.cmp(&indent) {
            std::cmp::Ordering::Equal if starts_item => starts.push(here),
            std::cmp::Ordering::Greater if !starts.is_empty() => {}
            // Less indented than the items, or at their indentation but not an item: another
            // key, or a layout left to the whole-file reading.
            _ => return None,
        }
    }
    (!starts.is_empty()).then_some(starts)
}

/// A tab, or a character that may start an anchor, alias or tag.
fn has_odd_byte(text: &str) -> bool {
    text.bytes()
        .any(|b| matches!(b, b'\t' | b'&' | b'*' | b'!'))
}

/// The `k`th item of a text cut at `starts`.
pub(super) fn item<'a>(text: &'a str, starts: &[usize], k: usize) -> &'a str {
    let end = starts.get(k + 1).copied().unwrap_or(text.len());
    &text[starts[k]..end]
}

/// What an edit changed, in items: the old items `first..end` gave way to new ones starting at
/// `starts` and ending at `to` (offsets in the new text); the items before `first` are where
/// they were, those from `end` on moved by `shift` bytes.
#[derive(Debug, PartialEq)]
pub(super) struct Edit {
    pub first: usize,
    pub end: usize,
    pub starts: Vec<usize>,
    pub to: usize,
    pub shift: isize,
}

impl Edit {
    /// The `k`th new item in the new text.
    pub(super) fn item<'a>(&self, text: &'a str, k: usize) -> &'a str {
        let end = self.starts.get(k + 1).copied().unwrap_or(self.to);
        &text[self.starts[k]..end]
    }
}

/// The items of `new` that differ from those of `old` (cut at `old_starts`), found from the
/// text the two share at their start and at their end, so that an edit of one item costs a
/// comparison of the texts and the cut of a few items, not a cut of the whole file. `None`
/// when the edit reaches the header, or the changed lines are not items of this layout
/// (at the old items' indentation): the caller then cuts the whole text.
pub(super) fn edit(old: &str, old_starts: &[usize], new: &str) -> Option<Edit> {
    // In bytes: the first difference may fall inside a character.
    let (old_bytes, new_bytes) = (old.as_bytes(), new.as_bytes());
    let same_start = common_prefix(old_bytes, new_bytes);
    let same_end = common_suffix(&old_bytes[same_start..], &new_bytes[same_start..]);
    // The item the first difference falls in: the line break before it is one both texts
    // have, so it starts a line in the new text too, which the cut below checks is still an
    // item at the same indentation (if the edit made it something else, the item before would
    // run on, and the whole text is cut instead).
    let first = old_starts
        .partition_point(|&start| start <= same_start)
        .checked_sub(1)?;
    let indent = old[old_starts[first]..]
        .bytes()
        .take_while(|&b| b == b' ')
        .count();
    // The first item whose whole first line, and the line break before it, both texts share
    // at their end: it and every item after it are the same text, moved.
    let old_tail = old.len() - same_end;
    let end = old_starts.partition_point(|&start| start <= old_tail);
    let shift = new.len() as isize - old.len() as isize;
    let to = match old_starts.get(end) {
        Some(&start) => start.checked_add_signed(shift)?,
        None => new.len(),
    };
    let from = old_starts[first];
    let starts = cut(new, from, to, indent)?;
    Some(Edit {
        first,
        end,
        starts,
        to,
        shift,
    })
}

/// How many bytes `a` and `b` share at their start: compared a block at a time (one `memcmp`
/// each), then byte by byte in the block that differs.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    let len = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= len && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..len]
        .iter()
        .zip(&b[at..len])
        .take_while(|(x, y)| x == y)
        .count()
}

/// How many bytes `a` and `b` share at their end, as [`common_prefix`] counts.
fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 4096;
    let len = a.len().min(b.len());
    let (a, b) = (&a[a.len() - len..], &b[b.len() - len..]);
    let mut same = 0;
    while same + BLOCK <= len
        && a[len - same - BLOCK..len - same] == b[len - same - BLOCK..len - same]
    {
        same += BLOCK;
    }
    same + a[..len - same]
        .iter()
        .rev()
        .zip(b[..len - same].iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
}

/// `services:`, alone or with a comment after it.
fn is_services_key(trimmed: &str) -> bool {
    trimmed.strip_prefix("services:").is_some_and(|rest| {
        let after = rest.trim_start();
        after.is_empty() || (after.starts_with('#') && rest.starts_with(' '))
    })
}

/// Whether the line has an anchor (`&a`), an alias (`*a`) or a tag (`!t`): one of those
/// characters where a token starts. Also true for such characters in comments and quoted
/// strings, which only costs the split.
fn has_node_property(line: &str) -> bool {
    let bytes = line.as_bytes();
    bytes.iter().enumerate().any(|(i, &b)| {
        matches!(b, b'&' | b'*' | b'!')
            && (i == 0 || matches!(bytes[i - 1], b' ' | b'[' | b'{' | b',' | b'-' | b':'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The item texts of a split.
    fn split(text: &str) -> Option<Vec<&str>> {
        let starts = super::split(text)?;
        Some((0..starts.len()).map(|k| item(text, &starts, k)).collect())
    }

    #[test]
    fn items_are_cut_at_their_dashes_with_their_comments() {
        let text = "# the mesh\nservices: # all of it\n  - path: /a/b\n    ports:\n      - port: 80\n\n  # next\n  - path: /a/c\n    ports: [{port: 81}]\n";
        assert_eq!(
            split(text).unwrap(),
            [
                "  - path: /a/b\n    ports:\n      - port: 80\n\n  # next\n",
                "  - path: /a/c\n    ports: [{port: 81}]\n",
            ]
        );
        // Items at column 0, and an item whose mapping starts on the next line.
        let text = "services:\n- path: /a/b\n  ports: []\n-\n  path: /a/c\n";
        assert_eq!(
            split(text).unwrap(),
            ["- path: /a/b\n  ports: []\n", "-\n  path: /a/c\n"]
        );
    }

    #[test]
    fn other_layouts_are_left_to_the_whole_file_reading() {
        for text in [
            "services: []\n",
            "services:\n",
            "",
            "---\nservices:\n  - path: /a/b\n",
            "services:\n  - path: /a/b\nother: 1\n",
            "other: 1\nservices:\n  - path: /a/b\n",
            "services:\n  - &a\n    path: /a/b\n  - *a\n",
            "services:\n  - path: !!str /a/b\n",
            "services:\n  - path: /a/b\n ports: []\n",
            "services:\n  - path: /a/b\n  ports: []\n",
            "services:\n\t- path: /a/b\n",
            "\"services\":\n  - path: /a/b\n",
            "services: {}\n",
        ] {
            assert_eq!(split(text), None, "{text:?}");
        }
    }

    #[test]
    fn a_star_inside_a_word_is_not_an_alias() {
        let text = "services:\n  - path: /a/b\n    clients: [ns/web*]\n";
        assert_eq!(split(text).unwrap().len(), 1);
        assert!(has_node_property("    clients: [*x]"));
        assert!(has_node_property("  - *x"));
        assert!(has_node_property("    path: &p /a/b"));
        assert!(!has_node_property("    path: /a/b&c"));
    }

    /// Edits anywhere in a file, of every kind (a character, a line, an item's dash, an item
    /// added or removed): where [`edit`] finds the changed items, they and the items it keeps
    /// are exactly the whole text's cut.
    #[test]
    fn an_edit_finds_the_items_the_whole_cut_finds() {
        let mut old = String::from("# mesh\nservices:\n");
        for i in 0..12 {
            old.push_str(&format!(
                "  # s{i}\n  - path: /a/s{i}\n    ports:\n      - port: 80\n    endpoints: [{{address: 10.0.0.{i}}}]\n"
            ));
        }
        let old_starts = super::split(&old).unwrap();
        let pieces = [
            "",
            "x",
            "\n",
            "- ",
            "  ",
            "  - path: /n/e\n    ports: []\n",
            "\n  - ",
            "#",
            "\t",
            "other: 1\n",
            "&a ",
            "\n    ",
        ];
        let (mut found, mut tried) = (0, 0);
        // Every position (on a stride) and length, with every piece.
        for at in (0..old.len()).step_by(7) {
            for len in [0, 1, 3, 40] {
                let end = (at + len).min(old.len());
                for piece in pieces {
                    let new = format!("{}{piece}{}", &old[..at], &old[end..]);
                    tried += 1;
                    let Some(edit) = edit(&old, &old_starts, &new) else {
                        continue;
                    };
                    found += 1;
                    let mut starts = old_starts.clone();
                    for start in &mut starts[edit.end..] {
                        *start = start.wrapping_add_signed(edit.shift);
                    }
                    starts.splice(edit.first..edit.end, edit.starts.iter().copied());
                    assert_eq!(Some(starts), super::split(&new), "{new:?}");
                    assert_eq!(
                        edit.to,
                        old_starts
                            .get(edit.end)
                            .map_or(new.len(), |&s| s.wrapping_add_signed(edit.shift))
                    );
                }
            }
        }
        // Most edits are past the first item and read by their items.
        assert!(found * 2 > tried, "{found} of {tried}");
        // An edit of the header is left to the whole cut; one of the first item is not.
        let header = old.replace("services:", "services: # all");
        assert_eq!(edit(&old, &old_starts, &header), None);
        let first = old.replace("/a/s0\n", "/a/t0\n");
        assert_eq!(edit(&old, &old_starts, &first).unwrap().first, 0);
        // The same text: the last item is cut again and nothing else.
        let same = edit(&old, &old_starts, &old).unwrap();
        assert_eq!((same.first, same.end, same.shift), (11, 12, 0));
        // Texts that first differ inside a character (ü and ö share their first byte).
        let umlaut = old.replace("/a/s5\n", "/a/s5ü\n");
        let umlaut_starts = super::split(&umlaut).unwrap();
        let changed = edit(&umlaut, &umlaut_starts, &umlaut.replace('ü', "ö")).unwrap();
        assert_eq!((changed.first, changed.end), (5, 6));
    }
}
