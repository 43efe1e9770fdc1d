//! What a newcomer reads first, checked against the repository: the README links every guide and
//! lists it in its layout, says which Rust it needs, pins every `cargo install` to the lock
//! file, and gives the gateway's new-key rate on every store whose replay rate it gives. Every
//! guide is part of the API docs too, in the crate it documents.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The text of the README's section headed `heading`, up to the next heading of its level.
fn section<'a>(readme: &'a str, heading: &str) -> &'a str {
    let start = readme
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("the README has no `{heading}`"));
    let rest = &readme[start + heading.len() + 2..];
    let level = heading.split(' ').next().unwrap();
    let end = rest.find(&format!("\n{level} ")).unwrap_or(rest.len());
    &rest[..end]
}

/// The guides: every file of `docs/`.
fn guides() -> Vec<String> {
    let mut guides: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".md"))
        .collect();
    guides.sort();
    assert!(guides.len() >= 12, "{guides:?}");
    guides
}

/// The Rust files under `dir`, recursively.
fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

#[test]
fn every_guide_is_in_the_api_docs() {
    let mut sources = Vec::new();
    for krate in std::fs::read_dir(root().join("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            rust_files(&src, &mut sources);
        }
    }
    // The `#[doc = include_str!(…)]` lines of every crate's sources.
    let included: Vec<String> = sources
        .iter()
        .flat_map(|path| {
            std::fs::read_to_string(path)
                .unwrap()
                .lines()
                .filter(|line| line.trim_start().starts_with("#[doc = include_str!("))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    for guide in guides() {
        let doc = format!("docs/{guide}\")]");
        assert!(
            included.iter().any(|line| line.contains(&doc)),
            "docs/{guide} is not in any crate's API docs (`#[doc = include_str!(…)]` in the crate it documents)"
        );
    }
}

#[test]
fn every_guide_is_linked_and_in_the_layout() {
    let readme = read("README.md");
    let linked = section(&readme, "## Guides");
    let layout = section(&readme, "## Layout");
    let docs_line: String = layout
        .lines()
        .skip_while(|line| !line.starts_with("docs/"))
        .take_while(|line| line.starts_with("docs/") || line.starts_with("    "))
        .collect();
    for guide in guides() {
        assert!(
            linked.contains(&format!("](docs/{guide})")),
            "docs/{guide} is not in the README's guides"
        );
        let name = guide.trim_end_matches(".md");
        assert!(
            docs_line.split([' ', ',']).any(|word| word == name),
            "{name} is not in the README's layout: {docs_line}"
        );
    }
}

/// Every `cargo install` a reader may copy builds what the lock file says: without `--locked`,
/// cargo resolves the dependencies anew, and the binary is not the one the suite tested.
#[test]
fn every_cargo_install_is_locked() {
    let mut files = vec!["README.md".to_owned(), "Containerfile".to_owned()];
    files.extend(guides().into_iter().map(|guide| format!("docs/{guide}")));
    for entry in std::fs::read_dir(root().join("scripts")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        files.push(format!("scripts/{name}"));
    }
    for file in files {
        // Joined across line breaks: a command may wrap.
        let text = read(&file).split_whitespace().collect::<Vec<_>>().join(" ");
        for (at, _) in text.match_indices("cargo install ") {
            let command: String = text[at..]
                .chars()
                .take_while(|c| !matches!(c, '`' | ';' | '&' | '|' | ')'))
                .collect();
            assert!(
                command.contains("--locked"),
                "{file}: `{command}` builds without --locked"
            );
        }
    }
}

#[test]
fn the_readme_names_the_minimum_rust() {
    let manifest = read("Cargo.toml");
    let version = manifest
        .lines()
        .find_map(|line| line.strip_prefix("rust-version = "))
        .unwrap()
        .trim_matches('"');
    let readme = read("README.md");
    let setup = section(&readme, "## Set-up: two commands");
    assert!(
        setup.contains(&format!("Rust, {version} or newer")),
        "the set-up does not say Rust {version}: {setup}"
    );
}

/// The README's sentence on the gateway against nginx gives the new-key rate on every store
/// it gives the replay rate on: a user on PostgreSQL needs that figure most.
#[test]
fn the_readme_gives_new_keys_wherever_it_gives_replays() {
    let readme = read("README.md");
    let sentence = readme
        .split("The gateway against nginx in one run:")
        .nth(1)
        .and_then(|rest| rest.split("; the profile").next())
        .expect("the README compares the gateway with nginx");
    let stores = |part: &str| -> Vec<String> {
        // Without the asides in parentheses.
        let mut depth = 0;
        let part: String = part
            .chars()
            .filter(|c| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => return depth == 0,
                }
                false
            })
            .collect();
        let mut stores: Vec<String> = part
            .split(" on ")
            .skip(1)
            .map(|rest| {
                rest.split([',', ';', ' ', '*'])
                    .next()
                    .unwrap()
                    .trim_end_matches('.')
                    .to_owned()
            })
            .collect();
        stores.sort();
        stores.dedup();
        stores
    };
    let (replays, new_keys) = sentence
        .split_once("new keys")
        .expect("new keys are in the sentence");
    assert_eq!(stores(replays), stores(new_keys), "{sentence}");
    assert!(stores(new_keys).contains(&"PostgreSQL".to_owned()), "{sentence}");
}
