//! What RE2, the regex engine of Envoy, accepts: its syntax, and a bound on the size of the
//! program it compiles a pattern to, which Envoy checks against its
//! `re2.max_program_size.error_level` runtime key and refuses past it.
//!
//! Rust's `regex` (whose parser reads the pattern here) accepts things RE2 does not: class set
//! operations (`&&`, `--`, `~~`) and nested classes (which RE2 reads as literal text, a
//! different pattern), the word boundaries `\<`, `\>`, `\b{start}` and the like, `\u` escapes,
//! the `x`, `u` and `R` flags, `(?<name>…)` on RE2 older than 2023, Unicode properties beyond
//! the general categories (RE2 matches names exactly; Rust also takes `\p{greek}` or
//! `\p{sc=Greek}`), a repetition of a repetition without a group, and counts past RE2's 1000
//! (also as a product of nested counts). Each is refused here with
//! what to write instead. A pattern RE2 refuses that Rust's parser also refuses needs no case.
//!
//! The program size is bounded from above, never under: RE2 compiles to a Thompson NFA (one
//! instruction per byte range of a literal or class piece, one `Alt` per alternative and
//! repetition, two per capture, `x{n,m}` as `m` copies of `x`), then flattens it, which at
//! most doubles the count (each `Alt` becomes at most two list entries). Classes are counted
//! by their UTF-8 byte-range sequences (RE2 shares suffixes among them, so it needs no more);
//! RE2's Perl classes (`\d`, `\s`, `\w`) are ASCII, as RE2 defines them.

use regex_syntax::ast::{
    self, AssertionKind, Ast, ClassPerlKind, ClassSet, ClassSetItem, ClassUnicodeKind, Flag,
    FlagsItemKind, GroupKind, HexLiteralKind, LiteralKind, RepetitionKind, RepetitionRange,
};
use regex_syntax::hir::{ClassUnicode, ClassUnicodeRange};
use regex_syntax::utf8::Utf8Sequences;

/// RE2's largest repetition count, also the largest product of nested counts.
const MAX_REPEAT: u32 = 1000;

/// RE2's general categories, the Unicode classes both engines name alike.
const GENERAL_CATEGORIES: [&str; 37] = [
    "Any", "C", "Cc", "Cf", "Co", "Cs", "L", "Ll", "Lm", "Lo", "Lt", "Lu", "M", "Mc", "Me", "Mn",
    "N", "Nd", "Nl", "No", "P", "Pc", "Pd", "Pe", "Pf", "Pi", "Po", "Ps", "S", "Sc", "Sk", "Sm",
    "So", "Z", "Zl", "Zp", "Zs",
];

/// Checks `pattern` against RE2's syntax; returns an upper bound of the size of the program
/// RE2 compiles it to. The error says what RE2 lacks and, where there is one, what to write.
pub fn program_size(pattern: &str) -> Result<u64, String> {
    if pattern.is_empty() {
        return Err("an empty regular expression matches everything: leave the match out".into());
    }
    let ast = ast::parse::Parser::new()
        .parse(pattern)
        .map_err(|e| e.kind().to_string())?;
    // The engine must accept it as well: a class range out of order, say, is only found there.
    regex_syntax::hir::translate::Translator::new()
        .translate(pattern, &ast)
        .map_err(|e| e.kind().to_string())?;
    let mut walk = Walk { pattern };
    let body = walk.size(&ast, Flags::default(), MAX_REPEAT)?;
    // A Fail and a Match instruction, and the `.*?` loop (two) of unanchored search; then
    // flattening, which at most doubles the count.
    Ok(body.saturating_add(4).saturating_mul(2))
}

#[derive(Clone, Copy, Default)]
struct Flags {
    case_insensitive: bool,
    dot_matches_new_line: bool,
}

impl Flags {
    fn apply(mut self, flags: &ast::Flags) -> Result<Flags, String> {
        let mut negated = false;
        for item in &flags.items {
            match &item.kind {
                FlagsItemKind::Negation => negated = true,
                FlagsItemKind::Flag(Flag::CaseInsensitive) => self.case_insensitive = !negated,
                FlagsItemKind::Flag(Flag::DotMatchesNewLine) => {
                    self.dot_matches_new_line = !negated
                }
                FlagsItemKind::Flag(Flag::MultiLine | Flag::SwapGreed) => {}
                FlagsItemKind::Flag(Flag::Unicode) => {
                    return Err(
                        "RE2 has no u flag (its classes \\d, \\s, \\w are always ASCII, \
                                \\pL and the like always Unicode)"
                            .into(),
                    );
                }
                FlagsItemKind::Flag(Flag::IgnoreWhitespace) => {
                    return Err("RE2 has no x flag (whitespace and # comments are literal \
                                text to it): remove them and the flag"
                        .into());
                }
                FlagsItemKind::Flag(Flag::CRLF) => {
                    return Err("RE2 has no R flag".into());
                }
            }
        }
        Ok(self)
    }
}

struct Walk<'a> {
    pattern: &'a str,
}

impl Walk<'_> {
    /// The instructions RE2 compiles `ast` to, at most. `budget` is what nested repetition
    /// counts leave of RE2's 1000.
    fn size(&mut self, ast: &Ast, flags: Flags, budget: u32) -> Result<u64, String> {
        Ok(match ast {
            // An empty match is a Nop.
            Ast::Empty(_) => 1,
            Ast::Flags(_) => 0,
            Ast::Literal(literal) => {
                let c = literal_char(literal)?;
                if flags.case_insensitive {
                    let mut class = ClassUnicode::new([ClassUnicodeRange::new(c, c)]);
                    class.case_fold_simple();
                    class_size(&class)
                } else {
                    c.len_utf8() as u64
                }
            }
            Ast::Dot(_) => {
                let mut class = if flags.dot_matches_new_line {
                    ClassUnicode::empty()
                } else {
                    ClassUnicode::new([ClassUnicodeRange::new('\n', '\n')])
                };
                class.negate();
                class_size(&class)
            }
            Ast::Assertion(assertion) => match assertion.kind {
                AssertionKind::StartLine
                | AssertionKind::EndLine
                | AssertionKind::StartText
                | AssertionKind::EndText
                | AssertionKind::WordBoundary
                | AssertionKind::NotWordBoundary => 1,
                _ => {
                    return Err(format!(
                        "RE2 knows only the word boundaries \\b and \\B, not {}",
                        self.text(&assertion.span)
                    ));
                }
            },
            Ast::ClassUnicode(class) => {
                let mut set = self.unicode_class(class)?;
                if flags.case_insensitive {
                    set.case_fold_simple();
                }
                class_size(&set)
            }
            Ast::ClassPerl(class) => {
                let mut set = perl_class(&class.kind);
                if class.negated {
                    set.negate();
                }
                class_size(&set)
            }
            Ast::ClassBracketed(class) => {
                let mut set = self.class_set(&class.kind)?;
                if flags.case_insensitive {
                    set.case_fold_simple();
                }
                if class.negated {
                    set.negate();
                }
                class_size(&set)
            }
            Ast::Repetition(repetition) => {
                if matches!(*repetition.ast, Ast::Repetition(_)) {
                    return Err(format!(
                        "RE2 refuses a repetition of a repetition ({}): put the inner one in a \
                         group, (?:…)",
                        self.text(&repetition.span)
                    ));
                }
                let (min, max) = match &repetition.op.kind {
                    RepetitionKind::ZeroOrOne => (0, Some(1)),
                    RepetitionKind::ZeroOrMore => (0, None),
                    RepetitionKind::OneOrMore => (1, None),
                    RepetitionKind::Range(range) => match *range {
                        RepetitionRange::Exactly(n) => (n, Some(n)),
                        RepetitionRange::AtLeast(n) => (n, None),
                        RepetitionRange::Bounded(n, m) => (n, Some(m)),
                    },
                };
                if min > MAX_REPEAT || max.is_some_and(|m| m > MAX_REPEAT) {
                    return Err(format!(
                        "{}: RE2 repeats at most {MAX_REPEAT} times",
                        self.text(&repetition.span)
                    ));
                }
                // RE2 checks the product of nested counts of 2 and more, as here.
                let count = max.unwrap_or(min);
                let inner_budget = if count >= 2 { budget / count } else { budget };
                if count >= 2 && inner_budget == 0 {
                    return Err(format!(
                        "{}: RE2 repeats at most {MAX_REPEAT} times, nested repetitions \
                         multiplied",
                        self.text(&repetition.span)
                    ));
                }
                let inner = self.size(&repetition.ast, flags, inner_budget)?;
                let (min, max) = (u64::from(min), max.map(u64::from));
                match max {
                    // x* and x+: the body and an Alt; x{n,}: n copies and an Alt.
                    None => inner.saturating_mul(min.max(1)).saturating_add(1),
                    Some(0) => 1,
                    // x{n,m}: m copies, the last m-n each behind an Alt.
                    Some(max) => inner.saturating_mul(max).saturating_add(max - min),
                }
            }
            Ast::Group(group) => {
                let (inner_flags, captures) = match &group.kind {
                    GroupKind::CaptureIndex(_) => (flags, 2),
                    GroupKind::CaptureName {
                        starts_with_p,
                        name,
                    } => {
                        if !starts_with_p {
                            return Err(format!(
                                "(?<{0}>…): write (?P<{0}>…), which every RE2 reads",
                                name.name
                            ));
                        }
                        if !name
                            .name
                            .chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_')
                        {
                            return Err(format!(
                                "capture name {:?}: RE2 takes letters, digits and _ only",
                                name.name
                            ));
                        }
                        (flags, 2)
                    }
                    GroupKind::NonCapturing(group_flags) => (flags.apply(group_flags)?, 0),
                };
                self.size(&group.ast, inner_flags, budget)?
                    .saturating_add(captures)
            }
            Ast::Alternation(alternation) => {
                let mut total: u64 = 0;
                for branch in &alternation.asts {
                    total = total.saturating_add(self.size(branch, flags, budget)?);
                }
                // One Alt between each two alternatives.
                total.saturating_add(alternation.asts.len().saturating_sub(1) as u64)
            }
            Ast::Concat(concat) => {
                // A flag group like (?i) holds for the rest of its group.
                let mut flags = flags;
                let mut total: u64 = 0;
                for item in &concat.asts {
                    if let Ast::Flags(set) = item {
                        flags = flags.apply(&set.flags)?;
                        continue;
                    }
                    total = total.saturating_add(self.size(item, flags, budget)?);
                }
                total
            }
        })
    }

    fn text(&self, span: &ast::Span) -> &str {
        self.pattern
            .get(span.start.offset..span.end.offset)
            .unwrap_or_default()
    }

    fn unicode_class(&self, class: &ast::ClassUnicode) -> Result<ClassUnicode, String> {
        let name = match &class.kind {
            ClassUnicodeKind::OneLetter(letter) => letter.to_string(),
            ClassUnicodeKind::Named(name) => name.clone(),
            ClassUnicodeKind::NamedValue { .. } => {
                return Err(format!(
                    "{}: RE2 names a class by itself (\\p{{Greek}}), not with = or :",
                    self.text(&class.span)
                ));
            }
        };
        if !GENERAL_CATEGORIES.contains(&name.as_str()) {
            return Err(format!(
                "{}: the Unicode classes RE2 and this agent both read are the general \
                 categories (\\pL, \\p{{Lu}}, \\p{{Nd}}, …) and \\p{{Any}}",
                self.text(&class.span)
            ));
        }
        // The class alone, through the same parser: its ranges, negation included.
        let text = self.text(&class.span);
        let hir = regex_syntax::Parser::new()
            .parse(text)
            .map_err(|e| e.to_string())?;
        match hir.kind() {
            regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) => {
                Ok(set.clone())
            }
            // \p{Any} and the like can translate to something other than a class; it
            // covers at most every character.
            _ => Ok(full_class()),
        }
    }

    /// The characters of a bracketed class's contents, before case folding and negation.
    fn class_set(&self, set: &ClassSet) -> Result<ClassUnicode, String> {
        match set {
            ClassSet::BinaryOp(op) => Err(format!(
                "{}: RE2 has no class set operations (&&, --, ~~); inside [] they are literal \
                 text to it",
                self.text(&op.span)
            )),
            ClassSet::Item(item) => self.class_item(item),
        }
    }

    fn class_item(&self, item: &ClassSetItem) -> Result<ClassUnicode, String> {
        Ok(match item {
            ClassSetItem::Empty(_) => ClassUnicode::empty(),
            ClassSetItem::Literal(literal) => {
                let c = literal_char(literal)?;
                ClassUnicode::new([ClassUnicodeRange::new(c, c)])
            }
            ClassSetItem::Range(range) => {
                let (start, end) = (literal_char(&range.start)?, literal_char(&range.end)?);
                ClassUnicode::new([ClassUnicodeRange::new(start, end)])
            }
            ClassSetItem::Ascii(class) => {
                // POSIX classes are ASCII in both engines; read through the same parser.
                let text = format!("[{}]", self.text(&class.span));
                match regex_syntax::Parser::new()
                    .parse(&text)
                    .map_err(|e| e.to_string())?
                    .kind()
                {
                    regex_syntax::hir::HirKind::Class(regex_syntax::hir::Class::Unicode(set)) => {
                        set.clone()
                    }
                    _ => full_class(),
                }
            }
            ClassSetItem::Unicode(class) => self.unicode_class(class)?,
            ClassSetItem::Perl(class) => {
                let mut set = perl_class(&class.kind);
                if class.negated {
                    set.negate();
                }
                set
            }
            ClassSetItem::Bracketed(nested) => {
                return Err(format!(
                    "{}: RE2 has no nested classes; to it [ inside [] is a literal [",
                    self.text(&nested.span)
                ));
            }
            ClassSetItem::Union(union) => {
                let mut set = ClassUnicode::empty();
                for item in &union.items {
                    set.union(&self.class_item(item)?);
                }
                set
            }
        })
    }
}

/// A literal's character, refusing the escapes only Rust reads.
fn literal_char(literal: &ast::Literal) -> Result<char, String> {
    match &literal.kind {
        LiteralKind::HexFixed(HexLiteralKind::UnicodeShort)
        | LiteralKind::HexFixed(HexLiteralKind::UnicodeLong)
        | LiteralKind::HexBrace(HexLiteralKind::UnicodeShort)
        | LiteralKind::HexBrace(HexLiteralKind::UnicodeLong) => Err(format!(
            "RE2 has no \\u or \\U escapes: write \\x{{{:X}}}",
            u32::from(literal.c)
        )),
        LiteralKind::Octal => {
            Err("RE2 and this agent disagree on octal escapes: write \\x{…}".into())
        }
        _ => Ok(literal.c),
    }
}

/// RE2's Perl classes: ASCII only.
fn perl_class(kind: &ClassPerlKind) -> ClassUnicode {
    let range = |a: char, b: char| ClassUnicodeRange::new(a, b);
    ClassUnicode::new(match kind {
        ClassPerlKind::Digit => vec![range('0', '9')],
        ClassPerlKind::Space => vec![range('\t', '\n'), range('\x0c', '\r'), range(' ', ' ')],
        ClassPerlKind::Word => vec![
            range('0', '9'),
            range('A', 'Z'),
            range('_', '_'),
            range('a', 'z'),
        ],
    })
}

fn full_class() -> ClassUnicode {
    ClassUnicode::new([ClassUnicodeRange::new('\0', char::MAX)])
}

/// The instructions a class compiles to, at most: a byte range per byte of each of its UTF-8
/// sequences, and an Alt between each two sequences. An empty class is one Fail.
fn class_size(class: &ClassUnicode) -> u64 {
    let mut bytes: u64 = 0;
    let mut sequences: u64 = 0;
    for range in class.ranges() {
        for sequence in Utf8Sequences::new(range.start(), range.end()) {
            bytes = bytes.saturating_add(sequence.as_slice().len() as u64);
            sequences += 1;
        }
    }
    if sequences == 0 {
        return 1;
    }
    bytes.saturating_add(sequences - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(pattern: &str, expected: &str) {
        let err = program_size(pattern).expect_err(pattern);
        assert!(err.contains(expected), "{pattern}: {err}");
    }

    #[test]
    fn what_rust_reads_and_re2_does_not_is_refused() {
        refused("[a-z&&[aeiou]]", "class set operations");
        refused("[a-z--b]", "class set operations");
        refused("[a~~b]", "class set operations");
        refused("[a[bc]]", "no nested classes");
        refused(r"\<word\>", "word boundaries");
        refused(r"\b{start}x", "word boundaries");
        refused(r"\b{end-half}", "word boundaries");
        refused(r"\u00e9", r"\x{E9}");
        refused(r"\u{e9}", r"\x{E9}");
        refused(r"\U000000e9", r"\x{E9}");
        refused("(?x) a b", "x flag");
        refused("(?u:a)", "u flag");
        refused("(?R)a$", "R flag");
        refused("(?<name>a)", "(?P<name>");
        refused(r"\p{Greek}", "general categories");
        refused(r"\p{greek}", "general categories");
        refused(r"\p{sc=Greek}", "not with =");
        refused(r"\p{Emoji}", "general categories");
        // Rust's parser refuses what RE2 reads as literal text, as here.
        refused("a{,5}", "repetition quantifier");
        refused("a{1001}", "at most 1000");
        refused("a{2,1001}", "at most 1000");
        refused("(a{10}){101}", "nested repetitions multiplied");
        refused("((a{2}){2}){251}", "nested repetitions multiplied");
        refused("a**", "repetition of a repetition");
        refused("", "empty");
        // What neither reads stays refused, with the parser's reason.
        refused("/v[0-9", "unclosed character class");
        refused("(?=x)", "look-around");
        refused(r"\1", "backreferences");
    }

    #[test]
    fn what_both_read_is_accepted() {
        for pattern in [
            "/v[0-9]+",
            "^/api/v[0-9]+/users/[^/]+$",
            r"(?i)/Users/\d+",
            "(?P<version>v[12])/.*",
            r"\pL+\p{Nd}\PN\P{Lu}",
            r"\p{Any}",
            r"[[:alpha:][:^digit:]_\-.]",
            r"\x41\x{10FFFF}\.\*\/\_\-",
            r"(?is:a.b)(?-i)c(?U)d*",
            r"\A\z\b\B^$",
            "(a{10}){100}",
            "a{1000}",
            "a|b||c",
            "[]a]",
            r"\t\n\r\f\v\a",
        ] {
            program_size(pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
        }
    }

    #[test]
    fn the_size_bound_follows_re2s_compilation() {
        // A literal byte is one instruction; a Fail, a Match and the `.*?` loop are four
        // more, and flattening may double it all.
        assert_eq!(program_size("a").unwrap(), 2 * (1 + 4));
        assert_eq!(program_size("abc").unwrap(), 2 * (3 + 4));
        // An alternation: the branches and an Alt between each two.
        assert_eq!(program_size("a|b|c").unwrap(), 2 * (3 + 2 + 4));
        // A capture: two more.
        assert_eq!(program_size("(a)").unwrap(), 2 * (1 + 2 + 4));
        // x{n,m}: m copies and m-n Alts. [a-z] is one byte range.
        assert_eq!(program_size("[a-z]{0,200}").unwrap(), 2 * (200 + 200 + 4));
        assert_eq!(program_size("a{3}").unwrap(), 2 * (3 + 4));
        assert_eq!(program_size("a{2,}").unwrap(), 2 * (2 + 1 + 4));
        assert_eq!(program_size("a*").unwrap(), 2 * (1 + 1 + 4));
        // Case folding: `k` folds to K, k and the Kelvin sign (three bytes): three sequences.
        assert_eq!(program_size("(?i)k").unwrap(), 2 * (1 + 1 + 3 + 2 + 4));
        // RE2's \d is ASCII: one range, not Rust's Unicode digits.
        assert_eq!(program_size(r"\d").unwrap(), 2 * (1 + 4));
        // Sizes multiply through nesting.
        let nested = program_size("(?:(?:ab){10}){10}").unwrap();
        assert_eq!(nested, 2 * (2 * 100 + 4));
        // A multi-byte literal is one instruction per byte.
        assert_eq!(program_size("é").unwrap(), 2 * (2 + 4));
    }

    #[test]
    fn unicode_classes_cost_their_utf8_sequences() {
        let dot = program_size(".").unwrap();
        let all = program_size("(?s).").unwrap();
        assert!(dot > program_size("[a-z]").unwrap());
        assert!(all <= dot + 2, "{all} {dot}");
        // Every general category has a bound, however large.
        assert!(program_size(r"\pL").unwrap() > 1000);
    }
}
