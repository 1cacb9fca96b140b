//! The `services` items of a mesh file as separate texts, so that an edit re-reads only the
//! items whose text changed.
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

/// The texts of the file's `services` items, in order, each from its `- ` line to the line
/// before the next item (comments and blank lines included); `None` when the layout is not
/// one this module splits, or the list is empty.
pub(super) fn split(text: &str) -> Option<Vec<&str>> {
    // Most files have none of these characters; only then is every line looked at for them.
    let check_lines = text
        .bytes()
        .any(|b| matches!(b, b'\t' | b'&' | b'*' | b'!'));
    let mut items = Vec::new();
    let mut in_services = false;
    // The items' indentation and where the current one starts, once the first is seen.
    let mut current: Option<(usize, usize)> = None;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
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
        if !in_services {
            if column != 0 || !is_services_key(trimmed) {
                return None;
            }
            in_services = true;
            continue;
        }
        match current {
            None if starts_item => current = Some((column, here)),
            None => return None,
            Some((indent, _)) if column > indent => {}
            Some((indent, start)) if column == indent && starts_item => {
                items.push(&text[start..here]);
                current = Some((indent, here));
            }
            // Less indented than the items, or at their indentation but not an item: another
            // key, or a layout left to the whole-file reading.
            Some(_) => return None,
        }
    }
    let (_, start) = current?;
    items.push(&text[start..]);
    Some(items)
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
}
