//! `docs/WRITING-AN-ADAPTER.md` names every case of the broker suite, and no case that is not
//! in it: the guide's table is what a new adapter's author reads the suite from.

use std::path::Path;

/// The cases listed in `__with_adapter_cases!`.
fn suite_cases() -> Vec<String> {
    let source = include_str!("../src/brokers.rs");
    let list = source
        .split("$($args)*;")
        .nth(1)
        .and_then(|rest| rest.split('}').next())
        .expect("the case list of __with_adapter_cases!");
    list.split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_guide_names_every_case_of_the_broker_suite() {
    let cases = suite_cases();
    assert!(cases.len() >= 11, "{cases:?}");
    let guide = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/WRITING-AN-ADAPTER.md");
    let guide = std::fs::read_to_string(guide).unwrap();
    for case in &cases {
        assert!(
            guide.contains(&format!("| `{case}` |")),
            "{case} is not in the guide's table"
        );
    }
    let listed = guide
        .lines()
        .filter_map(|line| line.strip_prefix("| `")?.split('`').next())
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .filter(|name| name.contains('_'));
    for name in listed {
        assert!(
            cases.iter().any(|case| case == name),
            "the guide lists {name}, which is not a case"
        );
    }
}
