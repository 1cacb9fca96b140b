//! What the agent reads of a mesh file: at most so many bytes, nested so deep, with so many
//! nodes once aliases are expanded. Checked by one linear scan of the text before the YAML
//! parser sees it, because the parser bounds none of these in time or memory: it reads the
//! whole document into events before anything looks at them, libyaml spends time in the
//! depth of flow nesting on every token (100k levels took about 29 s), and an alias is
//! expanded anew wherever it is used (a "billion laughs" document is a few hundred bytes).
//!
//! The scan is not a YAML parser. It follows what decides these limits (indentation and the
//! `- `, `? ` and `key:` indicators of block collections, brackets of flow collections, quoted
//! and block scalars, comments, anchors and aliases) and errs on the side of counting more:
//! a document it passes is within the limits as the parser reads it; one it refuses may be
//! slightly inside them when its layout is odd, never far.

use std::collections::HashMap;

/// The limits; [`Default`] is the agent's (docs/architecture.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub max_bytes: u64,
    pub max_depth: usize,
    /// Scalars and collections, each alias counting the nodes of its anchor.
    pub max_nodes: u64,
}

/// 16 MiB: four times a 10k-service file.
pub const DEFAULT_MAX_MIB: u64 = 16;
/// The deepest mesh file is about ten levels; the YAML parser itself stops at 128.
pub const DEFAULT_MAX_DEPTH: usize = 64;
/// A 10k-service file is about 300k nodes.
pub const DEFAULT_MAX_NODES: u64 = 2_000_000;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: DEFAULT_MAX_MIB << 20,
            max_depth: DEFAULT_MAX_DEPTH,
            max_nodes: DEFAULT_MAX_NODES,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    #[error(
        "the file is larger than the {limit} bytes the agent reads (--mesh-file-max-mib): \
         split it into several files"
    )]
    TooLarge { limit: u64 },
    #[error("line {line}: nested deeper than {limit} levels (--mesh-file-max-depth)")]
    TooDeep { line: usize, limit: usize },
    #[error(
        "line {line}: more than {limit} YAML nodes, each alias counting the nodes of its anchor \
         (--mesh-file-max-nodes)"
    )]
    TooManyNodes { line: usize, limit: u64 },
    #[error("line {line}: alias *{name} refers to a node that contains it")]
    RecursiveAlias { line: usize, name: String },
}

/// Scans `text` against `limits`. `outer_depth` is the nesting the text sits in (an item of
/// the `services` list is two levels down).
pub fn check(text: &str, limits: &Limits, outer_depth: usize) -> Result<(), LimitError> {
    if text.len() as u64 > limits.max_bytes {
        return Err(LimitError::TooLarge {
            limit: limits.max_bytes,
        });
    }
    Scan {
        bytes: text.as_bytes(),
        pos: 0,
        line: 1,
        line_start: 0,
        limits,
        outer_depth,
        block: Vec::new(),
        flow: 0,
        nodes: 0,
        anchors: HashMap::new(),
        open: Vec::new(),
    }
    .run()
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Sequence,
    Mapping,
}

/// An anchored node not yet complete: the nodes counted when it began, and where it ends.
struct OpenAnchor<'a> {
    name: &'a [u8],
    nodes_before: u64,
    end: AnchorEnd,
}

enum AnchorEnd {
    /// A block node owned by a key (`Mapping`) or a `- ` (`Sequence`) at this column: it ends
    /// at a line less indented, or as indented but for a key's `- ` entries.
    Block(usize, Kind),
    /// A node in a flow collection of this depth: it ends at the next `,` there, or with it.
    Flow(usize),
}

struct Scan<'a, 'l> {
    bytes: &'a [u8],
    pos: usize,
    line: usize,
    /// Where the current line starts: columns are counted from it.
    line_start: usize,
    limits: &'l Limits,
    outer_depth: usize,
    /// The open block collections: their column and kind.
    block: Vec<(usize, Kind)>,
    flow: usize,
    nodes: u64,
    /// Complete anchored nodes: their size in nodes.
    anchors: HashMap<&'a [u8], u64>,
    open: Vec<OpenAnchor<'a>>,
}

impl<'a> Scan<'a, '_> {
    fn run(mut self) -> Result<(), LimitError> {
        while self.pos < self.bytes.len() {
            if self.flow > 0 {
                self.flow_token()?;
            } else {
                self.block_line()?;
            }
        }
        Ok(())
    }

    fn peek(&self, at: usize) -> u8 {
        self.bytes.get(at).copied().unwrap_or(b'\n')
    }

    fn at_end_of_token(&self, at: usize) -> bool {
        matches!(self.peek(at), b' ' | b'\t' | b'\n' | b'\r')
    }

    fn skip_spaces(&mut self) {
        while matches!(self.peek(self.pos), b' ' | b'\t') && self.pos < self.bytes.len() {
            self.pos += 1;
        }
    }

    fn skip_line(&mut self) {
        while self.pos < self.bytes.len() && self.bytes[self.pos] != b'\n' {
            self.pos += 1;
        }
        if self.pos < self.bytes.len() {
            self.pos += 1;
            self.new_line();
        }
    }

    /// A line break was just passed.
    fn new_line(&mut self) {
        self.line += 1;
        self.line_start = self.pos;
    }

    fn column(&self) -> usize {
        self.pos - self.line_start
    }

    fn count(&mut self, nodes: u64) -> Result<(), LimitError> {
        self.nodes = self.nodes.saturating_add(nodes);
        if self.nodes > self.limits.max_nodes {
            return Err(LimitError::TooManyNodes {
                line: self.line,
                limit: self.limits.max_nodes,
            });
        }
        Ok(())
    }

    fn check_depth(&self) -> Result<(), LimitError> {
        if self.outer_depth + self.block.len() + self.flow > self.limits.max_depth {
            return Err(LimitError::TooDeep {
                line: self.line,
                limit: self.limits.max_depth,
            });
        }
        Ok(())
    }

    /// A block collection entry (`- `, `? ` or a key) at `column`; `first` when it is the
    /// line's first, which closes what the line is not inside of.
    fn block_entry(&mut self, column: usize, kind: Kind, first: bool) -> Result<(), LimitError> {
        if first {
            while let Some(&(c, k)) = self.block.last() {
                if c > column || (c == column && k == Kind::Sequence && kind == Kind::Mapping) {
                    self.block.pop();
                } else {
                    break;
                }
            }
        }
        if self.block.last() != Some(&(column, kind)) {
            self.block.push((column, kind));
            self.check_depth()?;
            self.count(1)?;
        }
        Ok(())
    }

    /// Completes the anchored nodes that end where the line at `indent` begins.
    fn end_block_anchors(&mut self, indent: usize, item: bool) {
        while let Some(open) = self.open.last() {
            let ends = match open.end {
                AnchorEnd::Block(column, Kind::Mapping) => {
                    indent < column || (indent == column && !item)
                }
                AnchorEnd::Block(column, Kind::Sequence) => indent <= column,
                AnchorEnd::Flow(_) => true,
            };
            if !ends {
                break;
            }
            self.end_anchor();
        }
    }

    fn end_anchor(&mut self) {
        if let Some(open) = self.open.pop() {
            let size = self.nodes.saturating_sub(open.nodes_before).max(1);
            self.anchors.insert(open.name, size);
        }
    }

    fn name(&mut self) -> &'a [u8] {
        let start = self.pos;
        while self.pos < self.bytes.len()
            && !matches!(
                self.bytes[self.pos],
                b' ' | b'\t' | b'\n' | b'\r' | b',' | b'[' | b']' | b'{' | b'}'
            )
        {
            self.pos += 1;
        }
        &self.bytes[start..self.pos]
    }

    fn anchor(&mut self, end: AnchorEnd) {
        self.pos += 1;
        let name = self.name();
        self.open.push(OpenAnchor {
            name,
            nodes_before: self.nodes,
            end,
        });
    }

    fn alias(&mut self) -> Result<(), LimitError> {
        self.pos += 1;
        let name = self.name();
        if self.open.iter().any(|open| open.name == name) {
            return Err(LimitError::RecursiveAlias {
                line: self.line,
                name: String::from_utf8_lossy(name).chars().take(64).collect(),
            });
        }
        // An alias to no anchor is the parser's error to report.
        let size = self.anchors.get(name).copied().unwrap_or(1);
        self.count(size)
    }

    /// Skips a quoted scalar starting at `pos`, which may span lines.
    fn quoted(&mut self) {
        let quote = self.bytes[self.pos];
        self.pos += 1;
        while self.pos < self.bytes.len() {
            let b = self.bytes[self.pos];
            self.pos += 1;
            match b {
                b'\n' => self.new_line(),
                b'\\' if quote == b'"' => {
                    let escaped = self.peek(self.pos);
                    self.pos += 1;
                    if escaped == b'\n' {
                        self.new_line();
                    }
                }
                b'\'' if quote == b'\'' && self.peek(self.pos) == b'\'' => self.pos += 1,
                _ if b == quote => return,
                _ => {}
            }
        }
    }

    /// One line in block context, from its start.
    fn block_line(&mut self) -> Result<(), LimitError> {
        let line_start = self.pos;
        while self.peek(self.pos) == b' ' && self.pos < self.bytes.len() {
            self.pos += 1;
        }
        let indent = self.pos - line_start;
        let c = self.peek(self.pos);
        if matches!(c, b'\n' | b'\r' | b'#')
            || (indent == 0 && (self.bytes[self.pos..].starts_with(b"---") || c == b'%'))
            || (indent == 0 && self.bytes[self.pos..].starts_with(b"..."))
        {
            self.skip_line();
            return Ok(());
        }
        let item = c == b'-' && self.at_end_of_token(self.pos + 1);
        self.end_block_anchors(indent, item);
        let mut column = indent;
        let mut first = true;
        // The column and kind that own the node this line's value is in.
        let mut owner = (indent, Kind::Mapping);
        loop {
            let c = self.peek(self.pos);
            match c {
                b'-' | b'?' if self.at_end_of_token(self.pos + 1) => {
                    let kind = if c == b'-' {
                        Kind::Sequence
                    } else {
                        Kind::Mapping
                    };
                    self.block_entry(column, kind, first)?;
                    owner = (column, kind);
                    first = false;
                    self.pos += 1;
                    self.skip_spaces();
                    column = self.column();
                }
                b'&' => {
                    self.anchor(AnchorEnd::Block(owner.0, owner.1));
                    self.skip_spaces();
                }
                b'!' => {
                    self.name();
                    self.skip_spaces();
                }
                b'*' => {
                    self.alias()?;
                    self.skip_spaces();
                    if self.peek(self.pos) == b':' {
                        // An alias as a key.
                        self.block_entry(column, Kind::Mapping, first)?;
                        owner = (column, Kind::Mapping);
                        first = false;
                        self.pos += 1;
                        self.skip_spaces();
                        column = self.column();
                        continue;
                    }
                    break;
                }
                b'[' | b'{' => {
                    // The flow collection runs from here, over lines if it must.
                    self.flow += 1;
                    self.pos += 1;
                    self.check_depth()?;
                    return self.count(1);
                }
                b'"' | b'\'' => {
                    self.quoted();
                    self.count(1)?;
                    self.skip_spaces();
                    if self.peek(self.pos) == b':' && self.at_end_of_token(self.pos + 1) {
                        self.block_entry(column, Kind::Mapping, first)?;
                        owner = (column, Kind::Mapping);
                        first = false;
                        self.pos += 1;
                        self.skip_spaces();
                        column = self.column();
                        continue;
                    }
                    break;
                }
                b'|' | b'>' => {
                    self.count(1)?;
                    self.skip_line();
                    // Its lines are those more indented than its owner, and blank ones.
                    loop {
                        let start = self.pos;
                        let mut at = start;
                        while self.peek(at) == b' ' && at < self.bytes.len() {
                            at += 1;
                        }
                        let blank = matches!(self.peek(at), b'\n' | b'\r');
                        if self.pos >= self.bytes.len() || (!blank && at - start <= owner.0) {
                            break;
                        }
                        self.skip_line();
                    }
                    return Ok(());
                }
                b'\n' | b'\r' | b'#' => break,
                _ => {
                    // A plain scalar, which is a key when `: ` (or `:` at the end) follows
                    // before a comment.
                    let mut at = self.pos;
                    let mut key = None;
                    while !matches!(self.peek(at), b'\n' | b'\r') && at < self.bytes.len() {
                        let b = self.bytes[at];
                        if b == b'#' && matches!(self.bytes[at - 1], b' ' | b'\t') {
                            break;
                        }
                        if b == b':' && self.at_end_of_token(at + 1) {
                            key = Some(at);
                            break;
                        }
                        at += 1;
                    }
                    self.count(1)?;
                    match key {
                        Some(colon) => {
                            self.block_entry(column, Kind::Mapping, first)?;
                            owner = (column, Kind::Mapping);
                            first = false;
                            self.pos = colon + 1;
                            self.skip_spaces();
                            column = self.column();
                        }
                        None => break,
                    }
                }
            }
        }
        self.skip_line();
        Ok(())
    }

    /// One token in flow context.
    fn flow_token(&mut self) -> Result<(), LimitError> {
        let b = self.bytes[self.pos];
        let token_start = self.pos == 0
            || matches!(
                self.bytes[self.pos - 1],
                b' ' | b'\t' | b'\n' | b'\r' | b'[' | b'{' | b',' | b':'
            );
        match b {
            b'[' | b'{' => {
                self.flow += 1;
                self.check_depth()?;
                self.count(1)?;
                self.pos += 1;
            }
            b']' | b'}' => {
                self.flow -= 1;
                self.pos += 1;
                while let Some(OpenAnchor {
                    end: AnchorEnd::Flow(level),
                    ..
                }) = self.open.last()
                {
                    if *level <= self.flow {
                        break;
                    }
                    self.end_anchor();
                }
                if self.flow == 0 {
                    // Back in block context: what follows on the line (a `: value` after a
                    // flow key, a comment) is left to the parser.
                    self.skip_line();
                }
            }
            b',' => {
                while let Some(OpenAnchor {
                    end: AnchorEnd::Flow(level),
                    ..
                }) = self.open.last()
                {
                    if *level < self.flow {
                        break;
                    }
                    self.end_anchor();
                }
                self.pos += 1;
            }
            b'"' | b'\'' if token_start => {
                self.quoted();
                self.count(1)?;
            }
            b'#' if token_start => self.skip_line(),
            b'&' if token_start => self.anchor(AnchorEnd::Flow(self.flow)),
            b'*' if token_start => self.alias()?,
            b'\n' => {
                self.pos += 1;
                self.new_line();
            }
            b' ' | b'\t' | b'\r' | b':' => self.pos += 1,
            _ => {
                if token_start {
                    self.count(1)?;
                }
                self.pos += 1;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_depth: usize, max_nodes: u64) -> Limits {
        Limits {
            max_bytes: 1 << 30,
            max_depth,
            max_nodes,
        }
    }

    fn depth_refused(text: &str, max_depth: usize) -> bool {
        matches!(
            check(text, &limits(max_depth, u64::MAX), 0),
            Err(LimitError::TooDeep { .. })
        )
    }

    /// The deepest nesting a scan lets through, found by lowering the limit until it refuses.
    fn depth(text: &str) -> usize {
        (0..200)
            .find(|&d| !depth_refused(text, d))
            .expect("some depth passes")
    }

    #[test]
    fn flow_nesting_counts_its_brackets() {
        assert_eq!(depth("a: [[[1]]]"), 4);
        assert_eq!(depth("a: {b: [c, {d: e}]}"), 4);
        // Brackets inside quotes, comments and plain block scalars are text.
        assert_eq!(depth("a: \"[[[[\"\nb: '{{{'\n# [[[[\nc: x[[[\n"), 1);
        assert_eq!(depth("a: [\"]]]\", '[[[', x]"), 2);
    }

    #[test]
    fn block_nesting_follows_indentation_and_indicators() {
        let file = "services:\n  - path: /a/b\n    ports:\n      - port: 80\n        name: http\n  - path: /c/d\n";
        // The root, services, a service, ports, a port.
        assert_eq!(depth(file), 5);
        // A sequence at its key's indentation is inside the key's value.
        assert_eq!(depth("a:\n- b:\n  - c\nd: e\n"), 4);
        // Compact nesting on one line.
        assert_eq!(depth("- - - - x\n"), 4);
        assert_eq!(depth("- a: - b\n"), 3);
        // Back out, then in again: the depth is the deepest, not the sum.
        assert_eq!(depth("a:\n  b:\n    c: 1\nd:\n  e: 2\n"), 3);
        // A block scalar's lines are text, whatever they hold.
        assert_eq!(depth("a: |\n  - - - - [[[[\n  b: c: d:\ne: f\n"), 1);
        // Outer levels count.
        assert!(check("a: 1", &limits(2, u64::MAX), 2).is_err());
        assert!(check("a: 1", &limits(3, u64::MAX), 2).is_ok());
    }

    #[test]
    fn a_deep_document_is_refused_with_its_line() {
        let text = format!(
            "services:\n  - path: {}1{}\n",
            "[".repeat(100),
            "]".repeat(100)
        );
        assert_eq!(
            check(&text, &Limits::default(), 0),
            Err(LimitError::TooDeep {
                line: 2,
                limit: DEFAULT_MAX_DEPTH
            })
        );
        let block = "- ".repeat(100) + "x\n";
        assert!(matches!(
            check(&block, &Limits::default(), 0),
            Err(LimitError::TooDeep { line: 1, .. })
        ));
    }

    #[test]
    fn aliases_count_what_their_anchor_holds() {
        // Billion laughs, nine levels of ten.
        let mut text = String::from("a0: &a0 [x]\n");
        for level in 1..10 {
            let refs = vec![format!("*a{}", level - 1); 10].join(", ");
            text.push_str(&format!("a{level}: &a{level} [{refs}]\n"));
        }
        assert!(matches!(
            check(&text, &Limits::default(), 0),
            Err(LimitError::TooManyNodes { .. })
        ));
        // The same in block style.
        let mut block = String::from("a0: &a0\n  - x\n");
        for level in 1..10 {
            block.push_str(&format!("a{level}: &a{level}\n"));
            for _ in 0..10 {
                block.push_str(&format!("  - *a{}\n", level - 1));
            }
        }
        assert!(matches!(
            check(&block, &Limits::default(), 0),
            Err(LimitError::TooManyNodes { .. })
        ));
        // A few aliases of a small anchor are fine, and counted.
        let shared = "ports: &web\n  - port: 80\n    protocol: http\nother: *web\nmore: *web\n";
        assert!(check(shared, &limits(64, 100), 0).is_ok());
        assert!(check(shared, &limits(64, 9), 0).is_err());
        // An anchor on a key's block sequence at the key's indentation holds all of it.
        let at_key = "a: &x\n- 1\n- 2\n- 3\nb: [*x, *x, *x]\n";
        let plain = "a: &x [1, 2, 3]\nb: [*x, *x, *x]\n";
        let count = |text: &str| (0..100).find(|&n| check(text, &limits(64, n), 0).is_ok());
        assert!(
            count(at_key) >= count(plain),
            "{:?} {:?}",
            count(at_key),
            count(plain)
        );
    }

    #[test]
    fn an_alias_inside_its_own_anchor_is_refused() {
        assert!(matches!(
            check("a: &x [1, *x]\n", &Limits::default(), 0),
            Err(LimitError::RecursiveAlias { .. })
        ));
        assert!(matches!(
            check("a: &x\n  b: *x\n", &Limits::default(), 0),
            Err(LimitError::RecursiveAlias { .. })
        ));
    }

    #[test]
    fn a_flood_of_nodes_is_refused() {
        let text = format!("a: [{}]\n", vec!["1"; 1000].join(","));
        assert!(check(&text, &limits(64, 500), 0).is_err());
        assert!(check(&text, &limits(64, 2000), 0).is_ok());
        let block = "- x\n".repeat(1000);
        assert!(check(&block, &limits(64, 500), 0).is_err());
    }

    #[test]
    fn size_is_checked_first() {
        let small = Limits {
            max_bytes: 4,
            ..Limits::default()
        };
        assert_eq!(
            check("services: []", &small, 0),
            Err(LimitError::TooLarge { limit: 4 })
        );
    }

    #[test]
    fn the_examples_pass() {
        let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
        for file in ["mesh.yaml", "blue-green.yaml"] {
            let text = std::fs::read_to_string(format!("{examples}/{file}")).unwrap();
            check(&text, &Limits::default(), 0).unwrap();
            assert!(depth(&text) < 16, "{file}: {}", depth(&text));
        }
    }
}
